//! The size histogram: requested sizes in power-of-two buckets, each with its allocations
//! and the bytes requested and allocated, so the fragmentation of each size class shows
//! where a site's (or a domain's) Frag % comes from. Sparse: a site uses a few buckets.
use serde::Serialize;

/// One bucket: requests of `min_size..=max_size` bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SizeBin {
    /// Smallest request the bucket holds.
    pub min_size: u64,
    /// Largest request the bucket holds (a power of two).
    pub max_size: u64,
    pub allocs: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
}

impl SizeBin {
    /// Internal fragmentation of this size class, as [`super::Stats::frag_pct`].
    pub fn frag_pct(&self) -> f64 {
        if self.bytes_alloc == 0 { 0.0 } else { 100.0 - 100.0 * self.bytes_req as f64 / self.bytes_alloc as f64 }
    }
}

/// Requested sizes, bucketed by the next power of two: bucket k holds (2^(k-1), 2^k], and
/// bucket 0 the requests of 0 and 1 byte.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SizeHistogram {
    /// (bucket, figures), sorted by bucket.
    bins: Vec<(u8, SizeBin)>,
}

/// The bucket of a request of `size` bytes.
pub fn bucket(size: u64) -> u8 {
    if size <= 1 { 0 } else { (64 - (size - 1).leading_zeros()) as u8 }
}

/// The bounds of bucket `k`: (smallest, largest) request it holds.
pub fn bounds(k: u8) -> (u64, u64) {
    match k {
        0 => (0, 1),
        64.. => ((1u64 << 63) + 1, u64::MAX),
        k => ((1u64 << (k - 1)) + 1, 1u64 << k),
    }
}

impl SizeHistogram {
    /// `count` allocations of `req` bytes requested, `alloc` allocated.
    pub fn record(&mut self, req: u64, alloc: u64, count: u64) {
        let k = bucket(req);
        let bin = match self.bins.binary_search_by_key(&k, |(b, _)| *b) {
            Ok(i) => &mut self.bins[i].1,
            Err(i) => {
                let (min_size, max_size) = bounds(k);
                // Most rows see one size class: room for one (a row per stack of a heavy
                // program's million stacks held room for four, 190 MB).
                self.bins.reserve_exact(1);
                self.bins.insert(i, (k, SizeBin { min_size, max_size, ..Default::default() }));
                &mut self.bins[i].1
            }
        };
        bin.allocs += count;
        bin.bytes_req += req * count;
        bin.bytes_alloc += alloc * count;
    }

    pub fn merge(&mut self, other: &Self) {
        for (k, o) in &other.bins {
            match self.bins.binary_search_by_key(k, |(b, _)| *b) {
                Ok(i) => {
                    let bin = &mut self.bins[i].1;
                    bin.allocs += o.allocs;
                    bin.bytes_req += o.bytes_req;
                    bin.bytes_alloc += o.bytes_alloc;
                }
                Err(i) => self.bins.insert(i, (*k, *o)),
            }
        }
    }

    /// The buckets used, smallest sizes first.
    pub fn bins(&self) -> impl Iterator<Item = &SizeBin> {
        self.bins.iter().map(|(_, b)| b)
    }

    pub fn is_empty(&self) -> bool {
        self.bins.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn buckets_end_at_powers_of_two() {
        assert_eq!([0, 1, 2, 3, 4, 5, 8, 9, 64, 65].map(bucket), [0, 0, 1, 2, 2, 3, 3, 4, 6, 7]);
        assert_eq!(bounds(0), (0, 1));
        assert_eq!(bounds(7), (65, 128));
        assert_eq!(bounds(bucket(u64::MAX)), ((1 << 63) + 1, u64::MAX));
        let mut h = SizeHistogram::default();
        h.record(77, 80, 3);
        h.record(16000, 16016, 1);
        h.record(100, 104, 1);
        h.record(1, 24, 2);
        let bins: Vec<SizeBin> = h.bins().copied().collect();
        assert_eq!(
            bins,
            [
                SizeBin { min_size: 0, max_size: 1, allocs: 2, bytes_req: 2, bytes_alloc: 48 },
                SizeBin { min_size: 65, max_size: 128, allocs: 4, bytes_req: 331, bytes_alloc: 344 },
                SizeBin { min_size: 8193, max_size: 16384, allocs: 1, bytes_req: 16000, bytes_alloc: 16016 },
            ]
        );
        assert!((bins[1].frag_pct() - (100.0 - 100.0 * 331.0 / 344.0)).abs() < 1e-9);
    }

    proptest! {
        #[test]
        fn every_size_lands_within_its_bounds(size in any::<u64>()) {
            let (lo, hi) = bounds(bucket(size));
            prop_assert!(lo <= size && size <= hi, "{} in {}..={}", size, lo, hi);
        }

        #[test]
        fn merging_is_adding(a in prop::collection::vec(0u64..1 << 20, 0..40), b in prop::collection::vec(0u64..1 << 20, 0..40)) {
            let (mut ha, mut hb, mut all) = (SizeHistogram::default(), SizeHistogram::default(), SizeHistogram::default());
            for &s in &a { ha.record(s, s + 8, 1); all.record(s, s + 8, 1); }
            for &s in &b { hb.record(s, s + 8, 1); all.record(s, s + 8, 1); }
            ha.merge(&hb);
            prop_assert_eq!(ha, all);
        }
    }
}
