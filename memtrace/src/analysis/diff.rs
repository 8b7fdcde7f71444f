//! Comparing two runs: rows of an old and a new recording matched by a key that does not
//! depend on addresses (the report names rows by their symbolized frames), each side's
//! rows with the same key added up, and the change in every figure.
use std::collections::BTreeMap;

use super::Stats;

/// What is compared of a row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delta {
    pub allocs: i64,
    pub frees: i64,
    pub bytes_req: i64,
    pub bytes_alloc: i64,
    pub live_allocs: i64,
    pub live_bytes_req: i64,
    /// Of the bytes live at the domain's peak.
    pub live_bytes_req_at_peak: i64,
    /// Of the row's own high ([`Stats::peak_live_bytes_req`]).
    pub peak_live_bytes_req: i64,
}

fn change(old: u64, new: u64) -> i64 {
    (i128::from(new) - i128::from(old)).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

impl Delta {
    pub fn between(old: &Stats, new: &Stats) -> Self {
        Self {
            allocs: change(old.allocs, new.allocs),
            frees: change(old.frees, new.frees),
            bytes_req: change(old.bytes_req, new.bytes_req),
            bytes_alloc: change(old.bytes_alloc, new.bytes_alloc),
            live_allocs: change(old.live_allocs, new.live_allocs),
            live_bytes_req: change(old.live_bytes_req, new.live_bytes_req),
            live_bytes_req_at_peak: change(old.live_bytes_req_at_peak, new.live_bytes_req_at_peak),
            peak_live_bytes_req: change(old.peak_live_bytes_req, new.peak_live_bytes_req),
        }
    }

    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// A key met in either run, with its figures in each (`None`: not in that run).
#[derive(Debug, Clone)]
pub struct Matched<K, R> {
    pub key: K,
    pub old: Option<(Stats, R)>,
    pub new: Option<(Stats, R)>,
}

impl<K, R> Matched<K, R> {
    pub fn delta(&self) -> Delta {
        let none = Stats::default();
        Delta::between(self.old.as_ref().map_or(&none, |o| &o.0), self.new.as_ref().map_or(&none, |n| &n.0))
    }

    /// The row to show: the new run's, else the old one's.
    pub fn shown(&self) -> &R {
        &self.new.as_ref().or(self.old.as_ref()).expect("in one run at least").1
    }
}

/// Adds up each side's rows per key and pairs the keys. `R` is what shows a key (its
/// first row on each side is kept). Keys in order.
pub fn match_rows<K: Ord + Clone, R>(
    old: impl IntoIterator<Item = (K, Stats, R)>,
    new: impl IntoIterator<Item = (K, Stats, R)>,
) -> Vec<Matched<K, R>> {
    let mut by_key: BTreeMap<K, Matched<K, R>> = BTreeMap::new();
    for (is_new, rows) in [(false, old.into_iter().collect::<Vec<_>>()), (true, new.into_iter().collect())] {
        for (key, stats, row) in rows {
            let m = by_key.entry(key.clone()).or_insert(Matched { key, old: None, new: None });
            let side = if is_new { &mut m.new } else { &mut m.old };
            match side {
                Some((s, _)) => s.merge(&stats),
                None => *side = Some((stats, row)),
            }
        }
    }
    by_key.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(allocs: u64, live: u64) -> Stats {
        Stats { allocs, bytes_req: allocs * 10, live_allocs: live, live_bytes_req: live * 10, ..Default::default() }
    }

    #[test]
    fn rows_match_by_key_and_add_up_per_side() {
        let old =
            vec![("leak", stats(4, 4), "old leak"), ("work", stats(100, 0), "old work"), ("gone", stats(1, 1), "g")];
        let new = vec![
            ("leak", stats(9, 9), "new leak"),
            ("work", stats(60, 0), "new work a"),
            ("work", stats(40, 0), "new work b"), // two addresses, one name: one row
            ("born", stats(2, 0), "b"),
        ];
        let m = match_rows(old, new);
        let keys: Vec<&str> = m.iter().map(|m| m.key).collect();
        assert_eq!(keys, ["born", "gone", "leak", "work"]);
        let leak = m[2].delta();
        assert_eq!((leak.allocs, leak.bytes_req, leak.live_allocs, leak.live_bytes_req), (5, 50, 5, 50));
        assert!(m[3].delta().is_zero(), "{:?}", m[3].delta());
        assert_eq!(*m[3].shown(), "new work a");
        assert_eq!((m[0].delta().allocs, m[1].delta().live_allocs), (2, -1));
        assert_eq!(*m[1].shown(), "g", "gone: shown as it was");
        assert_eq!(change(0, u64::MAX), i64::MAX);
    }
}
