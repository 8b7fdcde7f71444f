//! Memory over time, rebuilt from the events: live bytes per domain, per process and
//! (when asked) per group, in equal intervals from the start of the recording. Each
//! interval keeps the most bytes live at any moment within it, so a spike shorter than an
//! interval still shows and the peak's interval holds the peak. Intervals double in length
//! (halving their number) when a run outlasts them, so the series stay small for any run.
use std::collections::{BTreeMap, HashMap};

use super::Domain;

/// Intervals kept at most (between half this and this many once the run outlasts them).
pub const MAX_INTERVALS: u32 = 300;

/// An interval in which a series changed: the most it held then, and what it held at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Point {
    interval: u32,
    max: u64,
    end: u64,
}

/// One quantity over time, stored only where it changed.
#[derive(Debug, Clone, Default)]
pub struct Series {
    live: u64,
    points: Vec<Point>,
}

impl Series {
    fn set(&mut self, interval: u32, live: u64) {
        let before = self.live;
        self.live = live;
        match self.points.last_mut() {
            Some(p) if p.interval == interval => {
                p.max = p.max.max(live);
                p.end = live;
            }
            _ => self.points.push(Point { interval, max: before.max(live), end: live }),
        }
    }

    fn add(&mut self, interval: u32, bytes: u64, added: bool) {
        let live = if added { self.live + bytes } else { self.live.saturating_sub(bytes) };
        self.set(interval, live);
    }

    /// Merges pairs of intervals (interval i becomes i / 2).
    fn halve(&mut self) {
        let mut merged: Vec<Point> = Vec::with_capacity(self.points.len());
        for p in &self.points {
            let interval = p.interval / 2;
            match merged.last_mut() {
                Some(m) if m.interval == interval => {
                    m.max = m.max.max(p.max);
                    m.end = p.end;
                }
                _ => merged.push(Point { interval, ..*p }),
            }
        }
        self.points = merged;
    }

    /// The most held in each of the first `n` intervals.
    pub fn dense(&self, n: usize) -> Vec<u64> {
        let mut out = Vec::with_capacity(n);
        let mut carry = 0;
        let mut points = self.points.iter().peekable();
        for i in 0..n as u32 {
            match points.peek() {
                Some(p) if p.interval == i => {
                    out.push(p.max);
                    carry = p.end;
                    points.next();
                }
                _ => out.push(carry),
            }
        }
        out
    }

    /// The most held at any moment.
    pub fn max(&self) -> u64 {
        self.points.iter().map(|p| p.max).max().unwrap_or(0)
    }
}

/// Live bytes over time; see the module's comment.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// Time 0 (monotonic clock, as events).
    pub origin_ns: u64,
    /// Length of an interval.
    pub interval_ns: u64,
    /// The last interval an event fell in.
    last: u32,
    pub domains: BTreeMap<Domain, Series>,
    pub processes: HashMap<u32, Series>,
    /// Per group, when followed.
    groups: Option<Vec<Series>>,
}

/// The smallest "round" length (1, 2 or 5 times a power of ten nanoseconds) at least `ns`.
fn round_up(ns: u64) -> u64 {
    let mut scale = 1u64;
    loop {
        for m in [1, 2, 5] {
            if m * scale >= ns {
                return m * scale;
            }
        }
        scale = scale.saturating_mul(10);
    }
}

impl Timeline {
    /// A timeline starting at `origin_ns`, for a run expected to last `expected_ns` (0 if
    /// unknown); `per_group` follows each group too.
    pub fn new(origin_ns: u64, expected_ns: u64, per_group: bool) -> Self {
        let interval_ns =
            if expected_ns == 0 { 1_000_000 } else { round_up(expected_ns.div_ceil(u64::from(MAX_INTERVALS))) };
        Self {
            origin_ns,
            interval_ns: interval_ns.max(1),
            last: 0,
            domains: BTreeMap::new(),
            processes: HashMap::new(),
            groups: per_group.then(Vec::new),
        }
    }

    /// The interval `ts_ns` falls in, lengthening intervals as needed.
    fn interval(&mut self, ts_ns: u64) -> u32 {
        loop {
            let i = ts_ns.saturating_sub(self.origin_ns) / self.interval_ns;
            if i < u64::from(MAX_INTERVALS) {
                self.last = self.last.max(i as u32);
                return i as u32;
            }
            self.interval_ns *= 2;
            self.last /= 2;
            let all = self.domains.values_mut().chain(self.processes.values_mut());
            for s in all.chain(self.groups.iter_mut().flatten()) {
                s.halve();
            }
        }
    }

    /// `bytes` of group `group` (of `domain`, process `pid`) became live or stopped being
    /// live at `ts_ns`.
    pub fn change(&mut self, group: u32, domain: Domain, pid: u32, bytes: u64, added: bool, ts_ns: u64) {
        let i = self.interval(ts_ns);
        self.domains.entry(domain).or_default().add(i, bytes, added);
        self.processes.entry(pid).or_default().add(i, bytes, added);
        if let Some(groups) = &mut self.groups {
            let g = group as usize;
            if groups.len() <= g {
                groups.resize(g + 1, Series::default());
            }
            groups[g].add(i, bytes, added);
        }
    }

    /// How many intervals reach `end_ns` (at least the last one an event fell in).
    pub fn intervals_until(&mut self, end_ns: u64) -> usize {
        let last = self.interval(end_ns.max(self.origin_ns)).max(self.last);
        last as usize + 1
    }

    /// Group `group`'s series, if groups are followed.
    pub fn group(&self, group: u32) -> Option<&Series> {
        self.groups.as_ref().map(|g| g.get(group as usize).unwrap_or(&EMPTY))
    }
}

static EMPTY: Series = Series { live: 0, points: Vec::new() };

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn intervals_keep_the_most_held_within_them() {
        let mut t = Timeline::new(1000, 10_000, true);
        assert_eq!(t.interval_ns, 50, "10 µs in at most 300 round intervals");
        let u = Domain::User;
        t.change(0, u, 7, 100, true, 1000); // interval 0: 100
        t.change(0, u, 7, 50, true, 1010); // 150
        t.change(0, u, 7, 150, false, 1020); // 0: the interval still held 150
        t.change(1, u, 8, 30, true, 1300); // interval 6: 30
        t.change(2, Domain::Kernel, 0, 64, true, 1120); // interval 2
        let n = t.intervals_until(1400);
        assert_eq!(n, 9);
        assert_eq!(t.domains[&u].dense(n), [150, 0, 0, 0, 0, 0, 30, 30, 30]);
        assert_eq!(t.domains[&Domain::Kernel].dense(n), [0, 0, 64, 64, 64, 64, 64, 64, 64]);
        assert_eq!(t.processes[&7].dense(3), [150, 0, 0]);
        assert_eq!(t.group(1).unwrap().dense(n), [0, 0, 0, 0, 0, 0, 30, 30, 30]);
        assert_eq!(t.group(5).unwrap().dense(2), [0, 0], "a group never seen");
        assert_eq!(t.domains[&u].max(), 150);
        assert_eq!(Timeline::new(0, 0, false).group(0).map(|_| ()), None);
    }

    #[test]
    fn long_runs_lengthen_the_intervals() {
        let mut t = Timeline::new(0, 0, false);
        assert_eq!(t.interval_ns, 1_000_000, "1 ms when the length is unknown");
        t.change(0, Domain::User, 1, 10, true, 0);
        t.change(0, Domain::User, 1, 10, false, 1_500_000); // interval 1
        t.change(0, Domain::User, 1, 99, true, 700_000_000); // 700 ms: intervals of 4 ms
        assert_eq!(t.interval_ns, 4_000_000);
        let n = t.intervals_until(700_000_000);
        assert_eq!(n, 176);
        let dense = t.domains[&Domain::User].dense(n);
        assert_eq!((dense[0], dense[1], dense[174], dense[175]), (10, 0, 0, 99));
    }

    #[test]
    fn round_lengths() {
        assert_eq!([1, 2, 3, 6, 11, 999, 1001].map(round_up), [1, 2, 5, 10, 20, 1000, 2000]);
    }

    proptest! {
        /// Whatever the run, the highest interval equals the highest live bytes, and the
        /// peak's moment falls in it.
        #[test]
        fn the_highest_interval_holds_the_peak(ops in prop::collection::vec((0u64..5_000_000, 1u64..1000, any::<bool>()), 1..300)) {
            let mut ops = ops;
            ops.sort_by_key(|o| o.0);
            let mut t = Timeline::new(0, 1_000_000, false);
            let (mut live, mut peak, mut peak_ts) = (0u64, 0u64, 0u64);
            for (ts, bytes, add) in ops {
                let bytes = if add { bytes } else { bytes.min(live) };
                t.change(0, Domain::User, 1, bytes, add, ts);
                if add { live += bytes } else { live -= bytes }
                if live > peak { peak = live; peak_ts = ts; }
            }
            let n = t.intervals_until(5_000_000);
            let dense = t.domains.get(&Domain::User).map(|s| s.dense(n)).unwrap_or_default();
            let max = dense.iter().copied().max().unwrap_or(0);
            prop_assert_eq!(max, peak);
            if peak > 0 {
                let first = dense.iter().position(|&v| v == peak).unwrap() as u64;
                prop_assert_eq!(first, peak_ts / t.interval_ns);
            }
        }
    }
}
