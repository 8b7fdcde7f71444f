//! A log-linear histogram of durations (8 buckets per power of two, so a percentile is
//! within 12.5 % of the truth), cheap to update and to merge.
const SUB_BITS: u32 = 3;
const SUB: u64 = 1 << SUB_BITS;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

fn bucket(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= SUB_BITS
    let sub = (v >> (exp - SUB_BITS)) & (SUB - 1);
    ((exp - SUB_BITS + 1) as u64 * SUB + sub) as usize
}

/// Smallest value that lands in bucket `b`.
fn lower_bound(b: usize) -> u64 {
    let b = b as u64;
    if b < SUB {
        return b;
    }
    let exp = b / SUB - 1 + u64::from(SUB_BITS);
    let sub = b % SUB;
    (1 << exp) | (sub << (exp - u64::from(SUB_BITS)))
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        self.record_n(v, 1);
    }

    /// Records `n` observations of `v`.
    pub fn record_n(&mut self, v: u64, n: u64) {
        let b = bucket(v);
        if self.counts.len() <= b {
            self.counts.resize(b + 1, 0);
        }
        self.counts[b] += n;
        self.total += n;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn merge(&mut self, other: &Self) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The value at quantile `q` (0..=1): the middle of the bucket holding it.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let lo = lower_bound(b);
                let hi = lower_bound(b + 1);
                return Some(lo + (hi - lo) / 2);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn small_values_are_exact() {
        let mut h = Histogram::default();
        for v in [1, 2, 3, 4, 5] {
            h.record(v);
        }
        assert_eq!(h.quantile(0.5), Some(3));
        assert_eq!(h.quantile(1.0), Some(5));
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    proptest! {
        #[test]
        fn buckets_bound_their_values(v in 8u64..u64::MAX / 4) {
            let b = bucket(v);
            prop_assert!(lower_bound(b) <= v && v < lower_bound(b + 1), "{} in bucket {}", v, b);
        }

        #[test]
        fn quantiles_are_within_an_eighth(mut values in prop::collection::vec(1u64..10_000_000_000, 1..300)) {
            let mut h = Histogram::default();
            for &v in &values {
                h.record(v);
            }
            values.sort_unstable();
            let exact = values[(values.len() as f64 * 0.99).ceil() as usize - 1] as f64;
            let approx = h.quantile(0.99).unwrap() as f64;
            prop_assert!((approx - exact).abs() <= exact / 8.0 + 1.0, "{} vs {}", approx, exact);
        }
    }
}
