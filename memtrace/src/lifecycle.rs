//! Which task records are news. The reader drains the per-CPU rings one after another and
//! handles a drain's forks, execs and exits in time order, but a record can still reach it
//! a drain after a later record of its process (a ring read cut short by its batch bound):
//! a parent's fork after the child's exec, an exec after the exit. Handled as news, such a
//! fork pulled the exec'd child back into its parent's address space (its new ranges left
//! the probes for its whole life) and gave it its parent's Python interpreter; a stale
//! exit of a reused pid ended the new process. Each user of task records (the unwinder's
//! address spaces, the session's followers) asks here first.
use std::collections::VecDeque;

/// Exits remembered, to refuse a fork or exec record of the same process handled after its
/// exit (records cross the rings within a drain or two; thousands of exits is far more).
const EXITS_KEPT: usize = 4096;
/// Beginnings remembered: processes whose exit never comes (children of a traced process
/// not followed) must not grow the map for the whole session; a process that outlives
/// this many later forks and execs only stops refusing records older than its start.
const BEGINNINGS_KEPT: usize = 65536;

#[derive(Default)]
pub struct Lifecycles {
    /// pid → when the fork or exec that made it what it is now happened (ns, the probes'
    /// clock: `CLOCK_MONOTONIC`).
    since: crate::FastMap<u32, u64>,
    /// (pid, time) as `since` got them, oldest first; an entry leaves `since` only if it
    /// still holds that time.
    since_order: VecDeque<(u32, u64)>,
    /// pid → when it last exited, for the last [`EXITS_KEPT`] exits (`exit_order`: oldest
    /// first; an entry leaves the map only if the map still holds its time).
    exited: crate::FastMap<u32, u64>,
    exit_order: VecDeque<(u32, u64)>,
    /// Records refused.
    late: u64,
}

impl Lifecycles {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a record of `pid` made at `ts_ns` comes after everything known of it: not
    /// before its exit nor before what made it what it is now.
    pub fn is_news(&self, pid: u32, ts_ns: u64) -> bool {
        self.exited.get(&pid).is_none_or(|&exit| exit < ts_ns) && self.since.get(&pid).is_none_or(|&s| s <= ts_ns)
    }

    /// Whether `pid` was seen exiting at or after `ts_ns`.
    pub fn exited_since(&self, pid: u32, ts_ns: u64) -> bool {
        self.exited.get(&pid).is_some_and(|&exit| exit >= ts_ns)
    }

    /// A fork or exec of `pid` at `ts_ns`: whether it is news (then it is what `pid` is
    /// from now on); a late one is counted.
    pub fn began(&mut self, pid: u32, ts_ns: u64) -> bool {
        if !self.is_news(pid, ts_ns) {
            self.late += 1;
            return false;
        }
        self.set_since(pid, ts_ns);
        true
    }

    fn set_since(&mut self, pid: u32, ts_ns: u64) {
        remember(&mut self.since, &mut self.since_order, BEGINNINGS_KEPT, pid, ts_ns);
    }

    /// `pid` as `/proc` showed it, read from `ts_ns` on: later than any of its records made
    /// before that, whatever exits of earlier processes of that pid were seen.
    pub fn seen_alive(&mut self, pid: u32, ts_ns: u64) {
        self.exited.remove(&pid);
        self.set_since(pid, ts_ns);
    }

    /// `pid` exited at `ts_ns`: whether that ends the process known by that pid (not when
    /// a later fork of the pid, taken again, or a later exit was seen first).
    pub fn ended(&mut self, pid: u32, ts_ns: u64) -> bool {
        if !self.is_news(pid, ts_ns) {
            self.late += 1;
            return false;
        }
        self.since.remove(&pid);
        remember(&mut self.exited, &mut self.exit_order, EXITS_KEPT, pid, ts_ns);
        true
    }

    /// Records refused so far.
    pub fn late(&self) -> u64 {
        self.late
    }
}

/// Sets `pid`'s time in `map`, which keeps the last `kept` times set (`order`, oldest
/// first): an old one leaves the map only if the map still holds it.
fn remember(map: &mut crate::FastMap<u32, u64>, order: &mut VecDeque<(u32, u64)>, kept: usize, pid: u32, ts_ns: u64) {
    map.insert(pid, ts_ns);
    order.push_back((pid, ts_ns));
    while order.len() > kept {
        if let Some((old, at)) = order.pop_front()
            && map.get(&old) == Some(&at)
        {
            map.remove(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_older_than_what_is_known_of_a_pid_are_refused() {
        let mut l = Lifecycles::new();
        // The exec (200) read before the fork (100) that made the process.
        assert!(l.began(2, 200));
        assert!(!l.began(2, 100), "a late fork");
        // Its exit read before a late exec: the exec is old news.
        assert!(l.ended(3, 500));
        assert!(!l.began(3, 400));
        assert!(l.exited_since(3, 400) && !l.exited_since(3, 501) && !l.exited_since(2, 100));
        // The pid taken again by a process forked after that exit.
        assert!(l.began(3, 600));
        // An exit older than the pid's current process leaves it alone; one older than its
        // last exit too (a late exec of the newer process stays refused).
        assert!(!l.ended(3, 550));
        assert!(l.ended(3, 900));
        assert!(!l.ended(3, 700));
        assert!(!l.began(3, 800));
        assert_eq!(l.late(), 5);
        // Seen alive in /proc: news from then on, whatever exits came before.
        l.seen_alive(3, 1000);
        assert!(l.is_news(3, 1000) && !l.is_news(3, 999));
    }

    #[test]
    fn what_is_remembered_is_bounded() {
        let mut l = Lifecycles::new();
        for i in 0..3 * EXITS_KEPT as u32 {
            l.ended(i % 5000, u64::from(i) + 1);
        }
        assert!(l.exit_order.len() <= EXITS_KEPT);
        assert!(l.exited.len() <= EXITS_KEPT);
        // Processes that never exit (children not followed): bounded too.
        for i in 0..2 * BEGINNINGS_KEPT as u32 {
            assert!(l.began(100_000 + i, u64::from(i) + 1));
        }
        assert!(l.since.len() <= BEGINNINGS_KEPT && l.since_order.len() <= BEGINNINGS_KEPT);
        assert!(!l.began(100_000 + 2 * BEGINNINGS_KEPT as u32 - 1, 1), "the latest still refuse late records");
    }
}
