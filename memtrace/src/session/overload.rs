//! The switch to sampling when the rings overflow (without `--sample-bytes`): it owns when
//! the switch happens and the user heap blocks it must hand to the probes.
//!
//! Phase one, at the first loss: user allocations are sampled (each byte with probability
//! 1/[`MEAN`]) and every free is still sent, since the blocks allocated before are not
//! known to the probes. Phase two, once every event stamped before the switch has been
//! read (or [`CATCH_UP`] later if the rings do not catch up): the user heap blocks live at the
//! switch go into the probes' set of sampled blocks, and from then on only the frees of
//! blocks in that set are sent. Without phase two the frees alone kept the rings
//! overflowing on many CPUs (a 16-thread malloc/free loop on 16 CPUs lost 6.75 M events),
//! and a sampled block whose free is lost stays live for good.
//!
//! Until the switch this file keeps the live user heap blocks (pid, address) of the
//! traced processes, at most [`MAX_TRACKED`]: past that the switch stops at phase one.
use std::time::{Duration, Instant};

use memtrace_common::Space;

use crate::{FastMap, event::Event};

/// The mean sampling period of the switch, in bytes.
pub const MEAN: u64 = 64 << 10;

/// Live blocks followed before the switch: what fits in the probes' set with room left
/// for the blocks sampled after it.
pub const MAX_TRACKED: usize = memtrace_common::SAMPLED_LIVE_ENTRIES / 2;

/// How long phase one waits for the rings to catch up before phase two starts anyway
/// (pre-switch allocations read later are then handed over one by one). Every free is sent
/// meanwhile: with a second here, 16 threads of malloc/free on 16 CPUs (9.6 M events in
/// 1.4 s) kept the rings overflowing to the end and lost two thirds of their events.
const CATCH_UP: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No loss yet: following the live blocks.
    Watching,
    /// Sampling since `since_ns`; every free still sent.
    Sampling { since_ns: u64, at: Instant },
    /// Only the frees of blocks in the probes' set are sent.
    Filtering { since_ns: u64 },
    /// Too many live blocks to hand over: sampling, every free sent, for good.
    SamplingOnly,
}

pub struct Overload {
    phase: Phase,
    /// Live user heap blocks: (pid, address).
    live: FastMap<(u32, u64), ()>,
    /// Pre-switch allocations read after phase two started: handed over at the next
    /// housekeeping.
    late: Vec<(u32, u64)>,
    /// More than [`MAX_TRACKED`] blocks were live at once: no phase two.
    untrackable: bool,
}

impl Default for Overload {
    fn default() -> Self {
        Self::new()
    }
}

impl Overload {
    pub fn new() -> Self {
        Self { phase: Phase::Watching, live: FastMap::default(), late: Vec::new(), untrackable: false }
    }

    /// Whether frees are filtered by the probes (phase two).
    pub fn filtering(&self) -> bool {
        matches!(self.phase, Phase::Filtering { .. })
    }

    /// Follows one event in time order.
    pub fn observe(&mut self, event: &Event) {
        let (pid, ptr, ts, free) = match event {
            Event::Alloc(a) if a.kind.space() == Space::Heap => (a.pid, a.ptr, a.ts_ns, false),
            Event::Free(f) if f.kind.space() == Space::Heap => (f.pid, f.ptr, f.ts_ns, true),
            _ => return,
        };
        if self.untrackable {
            return;
        }
        match self.phase {
            Phase::Watching => {}
            // Sampled after the switch: the probes put it in their set themselves.
            Phase::Sampling { since_ns, .. } if !free && ts >= since_ns => return,
            Phase::Sampling { .. } => {}
            Phase::Filtering { since_ns } => {
                if !free && ts < since_ns {
                    self.late.push((pid, ptr));
                }
                return;
            }
            Phase::SamplingOnly => return,
        }
        if free {
            self.live.remove(&(pid, ptr));
        } else {
            self.live.insert((pid, ptr), ());
            if self.live.len() > MAX_TRACKED {
                self.give_up();
            }
        }
    }

    fn give_up(&mut self) {
        self.live = FastMap::default();
        self.untrackable = true;
        if matches!(self.phase, Phase::Sampling { .. }) {
            self.phase = Phase::SamplingOnly;
        }
    }

    /// Whether phase two cannot happen: too many blocks were live at once.
    pub fn untrackable(&self) -> bool {
        self.untrackable
    }

    /// The rings lost events: switch to sampling (phase one). Returns false if already
    /// switched.
    pub fn switch(&mut self, now_ns: u64) -> bool {
        if self.phase != Phase::Watching {
            return false;
        }
        self.phase = if self.untrackable {
            Phase::SamplingOnly
        } else {
            Phase::Sampling { since_ns: now_ns, at: Instant::now() }
        };
        true
    }

    /// Phase two is due: every ring was read dry by a drain that began after the switch
    /// (`caught_up_ns`: when the last such drain began), or the rings did not catch up
    /// within [`CATCH_UP`]. Returns the blocks to hand over; the caller then turns the
    /// filter on and calls [`Overload::handed_over`].
    pub fn due(&mut self, caught_up_ns: u64) -> Option<Vec<(u32, u64)>> {
        match self.phase {
            Phase::Sampling { since_ns, at } if caught_up_ns > since_ns || at.elapsed() >= CATCH_UP => {
                Some(std::mem::take(&mut self.live).into_keys().collect())
            }
            Phase::Filtering { .. } if !self.late.is_empty() => Some(std::mem::take(&mut self.late)),
            _ => None,
        }
    }

    /// The probes took a handover.
    pub fn handed_over(&mut self) {
        if let Phase::Sampling { since_ns, .. } = self.phase {
            self.phase = Phase::Filtering { since_ns };
        }
    }

    /// Live blocks followed (tests, debug).
    pub fn tracked(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::Kind;

    use super::*;
    use crate::event::{Alloc, Free};

    fn alloc(pid: u32, ptr: u64, ts: u64) -> Event {
        Event::Alloc(Alloc {
            ts_ns: ts,
            pid,
            tid: pid,
            cpu: 0,
            kind: Kind::Malloc,
            flags: 0,
            ptr,
            bytes_req: 16,
            bytes_alloc: 24,
            stack: 0,
            call_site: 0,
            gfp_flags: 0,
            node: -1,
            order: 0,
            allocator: 1,
            cache: 0,
        })
    }

    fn free(pid: u32, ptr: u64, ts: u64) -> Event {
        Event::Free(Free { ts_ns: ts, pid, tid: pid, cpu: 0, kind: Kind::Free, flags: 0, ptr, arg: 0 })
    }

    #[test]
    fn hands_over_the_blocks_live_at_the_switch() {
        let mut o = Overload::new();
        o.observe(&alloc(1, 0x10, 1));
        o.observe(&alloc(1, 0x20, 2));
        o.observe(&alloc(2, 0x10, 3));
        o.observe(&free(1, 0x10, 4));
        assert!(o.switch(10));
        assert!(!o.switch(11), "one switch");
        // Read after the switch but stamped before it: still followed.
        o.observe(&alloc(1, 0x30, 9));
        o.observe(&free(1, 0x20, 9));
        // Sampled after it: the probes track those themselves.
        o.observe(&alloc(1, 0x40, 12));
        assert!(o.due(9).is_none(), "rings not caught up yet");
        let mut blocks = o.due(11).expect("due");
        blocks.sort();
        assert_eq!(blocks, vec![(1, 0x30), (2, 0x10)]);
        o.handed_over();
        assert!(o.filtering());
        // A pre-switch allocation read late is handed over on its own.
        o.observe(&alloc(3, 0x50, 8));
        o.observe(&alloc(3, 0x60, 13));
        assert_eq!(o.due(20).expect("late"), vec![(3, 0x50)]);
        assert!(o.due(21).is_none());
    }

    #[test]
    fn kernel_and_mmap_events_are_not_followed() {
        let mut o = Overload::new();
        let mut k = alloc(1, 0x10, 1);
        if let Event::Alloc(a) = &mut k {
            a.kind = Kind::Kmalloc;
        }
        o.observe(&k);
        let mut m = alloc(1, 0x20, 1);
        if let Event::Alloc(a) = &mut m {
            a.kind = Kind::Mmap;
        }
        o.observe(&m);
        assert_eq!(o.tracked(), 0);
    }

    #[test]
    fn too_many_live_blocks_keeps_every_free() {
        let mut o = Overload::new();
        for i in 0..=MAX_TRACKED as u64 {
            o.observe(&alloc(1, 0x1000 + i * 16, i));
        }
        assert_eq!(o.tracked(), 0, "the set is dropped past its bound");
        assert!(o.untrackable());
        o.observe(&alloc(1, 0x10, 1));
        assert_eq!(o.tracked(), 0, "and not filled again");
        assert!(o.switch(u64::MAX / 2));
        assert!(o.due(u64::MAX).is_none(), "no phase two");
        assert!(!o.filtering());
    }

    #[test]
    fn the_switch_goes_ahead_when_the_rings_never_catch_up() {
        let mut o = Overload::new();
        o.observe(&alloc(1, 0x10, 1));
        assert!(o.switch(10));
        o.phase = Phase::Sampling { since_ns: 10, at: Instant::now() - CATCH_UP };
        assert_eq!(o.due(0).expect("due"), vec![(1, 0x10)]);
    }
}
