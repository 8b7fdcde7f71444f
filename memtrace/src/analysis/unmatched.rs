//! Frees without an allocation, per process, counted with little memory: the user heap
//! paired as [`super::Analyzer`] pairs it, keeping only each live block's address and
//! time. The end of `record` tallies its warnings with this while it names frames; the
//! report's `Analyzer` counts the same (a property test below holds the two equal). On
//! PyTorch the `Analyzer` held 100 MB of live blocks for it, and 129 MB of groups.
use memtrace_common::{Space, TaskEvent, flags};

use super::{forks::Forks, recent::RecentFrees};
use crate::event::{Alloc, Event, Free};

/// Pairs user heap allocations and frees to count, per pid, the frees whose allocation
/// was not seen (after the rules that tell the allocator's own frees and a forked child's
/// inherited blocks from them).
#[derive(Default)]
pub struct UnmatchedFrees {
    /// Per process instance: live block address → allocation time.
    heap: crate::FastMap<u32, crate::FastMap<u64, u64>>,
    recent_frees: crate::FastMap<u32, RecentFrees>,
    /// tid → (pid, unmatched frees since its last allocation).
    pending: crate::FastMap<u32, (u32, u64)>,
    instances: crate::FastMap<u32, u32>,
    next_instance: u32,
    /// Forked processes' ancestors, until they exec or exit.
    forks: Forks,
    /// From this time on, user events were sampled (frees of unsampled blocks arrive).
    sample_from: Option<u64>,
    /// pid → frees of heap blocks whose allocation was not seen (after [`Self::finish`]).
    pub by_pid: crate::FastMap<u32, u64>,
}

impl UnmatchedFrees {
    /// `sample_from`: when the recording fell back to sampling, if it did.
    pub fn new(sample_from: Option<u64>) -> Self {
        Self { next_instance: 1, sample_from, ..Default::default() }
    }

    pub fn push(&mut self, event: &Event) {
        match event {
            Event::Alloc(a) => self.alloc(a),
            Event::Free(f) => self.free(f),
            Event::Task(t) => {
                if t.event == TaskEvent::Exit
                    && let Some((pid, n)) = self.pending.remove(&t.tid)
                    && t.tid == t.pid
                {
                    // A thread's are the allocator's own frees at its exit; a main
                    // thread's, the program's (the `Analyzer`'s rule).
                    *self.by_pid.entry(pid).or_default() += n;
                }
                if t.event == TaskEvent::Fork
                    && let Some(parent_space) = self.instance(memtrace_common::Kind::Malloc, t.ppid)
                {
                    if t.flags & flags::SHARED_MEMORY != 0 {
                        self.forks.shared(t.pid);
                        self.instances.insert(t.pid, parent_space);
                    } else {
                        self.forks.forked(t.pid, t.ppid, parent_space, t.ts_ns);
                    }
                }
                if t.ends_address_space() {
                    let shared = self.forks.stops_sharing(t.pid);
                    self.forks.ended(t.pid, t.event == TaskEvent::Exit);
                    if let Some(instance) = self.instances.remove(&t.pid)
                        && !shared
                    {
                        self.recent_frees.remove(&instance);
                        self.heap.remove(&instance);
                    }
                }
            }
        }
    }

    /// Settles the frees still undecided; call once after the last event.
    pub fn finish(&mut self) {
        for (_, (pid, n)) in self.pending.drain() {
            *self.by_pid.entry(pid).or_default() += n;
        }
    }

    /// The process instance of a user-space event (any of them starts one, as in the
    /// `Analyzer`: a fork then finds its parent's).
    fn instance(&mut self, kind: memtrace_common::Kind, pid: u32) -> Option<u32> {
        if matches!(kind.space(), Space::Slab | Space::Page) {
            return None;
        }
        let next = &mut self.next_instance;
        Some(*self.instances.entry(pid).or_insert_with(|| {
            let id = *next;
            *next += 1;
            id
        }))
    }

    fn alloc(&mut self, a: &Alloc) {
        let Some(instance) = self.instance(a.kind, a.pid) else { return };
        if a.kind.space() != Space::Heap {
            return;
        }
        if let Some((pid, n)) = self.pending.remove(&a.tid) {
            *self.by_pid.entry(pid).or_default() += n;
        }
        if a.flags & flags::FAILED != 0 {
            return;
        }
        if let Some(recent) = self.recent_frees.get_mut(&instance) {
            recent.remove(a.ptr);
        }
        self.heap.entry(instance).or_default().insert(a.ptr, a.ts_ns);
    }

    fn free(&mut self, f: &Free) {
        let Some(instance) = self.instance(f.kind, f.pid) else { return };
        if f.kind.space() != Space::Heap {
            return;
        }
        if self.heap.get_mut(&instance).and_then(|m| m.remove(&f.ptr)).is_some() {
            self.recent_frees.entry(instance).or_default().insert(f.ptr);
            return;
        }
        let sampled = self.sample_from.is_some_and(|from| f.ts_ns >= from);
        let recent = self.recent_frees.get(&instance).is_some_and(|r| r.contains(f.ptr));
        if sampled || recent || self.inherited(f.pid, f.ptr) {
            return;
        }
        self.pending.entry(f.tid).or_insert((f.pid, 0)).1 += 1;
    }

    /// Whether `ptr` is a block of an address space `pid`'s heap was copied from, allocated
    /// before the copy.
    fn inherited(&self, pid: u32, ptr: u64) -> bool {
        let allocated = |space: u32, ptr: u64| self.heap.get(&space).and_then(|m| m.get(&ptr)).copied();
        let freed = |space: u32, ptr: u64| self.recent_frees.get(&space).is_some_and(|r| r.contains(ptr));
        self.forks.inherited(pid, ptr, allocated, freed)
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::Kind;
    use proptest::prelude::*;

    use super::*;
    use crate::{
        analysis::{Analyzer, Origin},
        event::Task,
    };

    /// An event from a small world: 3 pids, 2 threads each, 6 addresses, so that frees
    /// meet live, freed, inherited and never-seen blocks.
    fn event(ts: u64, what: u8, pid: u32, tid: u32, ptr: u64, kind: u8) -> Event {
        // Whether an exit ends the process, apart from which process and thread exit.
        let group_dead = kind.is_multiple_of(2);
        let kind = [Kind::Malloc, Kind::Free, Kind::Mmap, Kind::Munmap, Kind::KmemCacheAlloc, Kind::KmemCacheFree]
            [kind as usize % 6];
        let (pid, tid) = (1 + pid % 3, 1 + pid % 3 + 10 * (tid % 2));
        let ptr = 0x1000 * (1 + ptr % 6);
        let task = |event: TaskEvent, flags: u8, ppid: u32| {
            Event::Task(Task { ts_ns: ts, event, flags, pid, tid, ppid, comm: String::new(), filename: String::new() })
        };
        match what % 10 {
            0..=3 => Event::Alloc(Alloc {
                ts_ns: ts,
                pid,
                tid,
                cpu: 0,
                kind: if kind.is_free() { Kind::Malloc } else { kind },
                flags: if what == 3 && ptr == 0x1000 { flags::FAILED } else { 0 },
                ptr,
                bytes_req: 8,
                bytes_alloc: 8,
                stack: 0,
                call_site: 0,
                gfp_flags: 0,
                node: -1,
                order: 0,
                allocator: 0,
                cache: 0,
            }),
            4..=6 => Event::Free(crate::event::Free {
                ts_ns: ts,
                pid,
                tid,
                cpu: 0,
                kind: match kind {
                    Kind::Malloc => Kind::Free,
                    Kind::Mmap => Kind::Munmap,
                    Kind::KmemCacheAlloc => Kind::KmemCacheFree,
                    k => k,
                },
                flags: 0,
                ptr,
                arg: 1,
            }),
            // Forked from the pid before it in the cycle.
            7 => task(TaskEvent::Fork, 0, 1 + (pid + 1) % 3),
            8 => task(TaskEvent::Exec, 0, 0),
            _ => task(TaskEvent::Exit, if group_dead { flags::GROUP_DEAD } else { 0 }, 0),
        }
    }

    proptest! {
        #[test]
        fn counts_as_the_analyzer_counts(
            raw in prop::collection::vec((0u8..10, 0u32..3, 0u32..2, 0u64..6, 0u8..6), 0..300),
            sample_at in prop::option::of(0u64..300),
        ) {
            let events: Vec<Event> = raw
                .iter()
                .enumerate()
                .map(|(i, &(what, pid, tid, ptr, kind))| event(i as u64, what, pid, tid, ptr, kind))
                .collect();
            let mut analyzer = Analyzer::new(|_: &Origin| 0);
            analyzer.sample_from = sample_at.map(|at| (at, 4096));
            let mut compact = UnmatchedFrees::new(sample_at);
            for e in &events {
                analyzer.push(e);
                compact.push(e);
            }
            analyzer.finish();
            compact.finish();
            let mut expected: Vec<(u32, u64)> =
                analyzer.unmatched_by_pid.iter().map(|(&p, &n)| (p, n)).filter(|&(_, n)| n > 0).collect();
            let mut got: Vec<(u32, u64)> =
                compact.by_pid.iter().map(|(&p, &n)| (p, n)).filter(|&(_, n)| n > 0).collect();
            expected.sort_unstable();
            got.sort_unstable();
            prop_assert_eq!(got, expected);
        }
    }

    #[test]
    fn a_forked_child_freeing_its_parents_block_is_not_unmatched() {
        let mut u = UnmatchedFrees::new(None);
        // pid 1 started while traced (its exec): its blocks are all seen.
        let exec = event(0, 8, 0, 0, 0, 0);
        for e in
            [exec, event(1, 0, 0, 0, 0, 0), event(2, 7, 1, 0, 0, 0), event(3, 4, 1, 0, 0, 0), event(4, 4, 1, 0, 1, 0)]
        {
            u.push(&e);
        }
        u.finish();
        // pid 2 (forked from pid 1) freed 0x1000, pid 1's, and 0x2000, nobody's.
        assert_eq!(u.by_pid.get(&2), Some(&1));
        assert_eq!(u.by_pid.get(&1), None);
    }

    #[test]
    fn a_parent_seen_only_mapping_memory_still_has_forked_children() {
        // pid 1 maps memory (its first event), pid 2 forks from it; pid 1 then allocates
        // and frees 0x1000, which pid 2 frees too: the parent's recent free, not unmatched.
        let events = [
            event(1, 0, 0, 0, 0, 2),
            event(2, 7, 1, 0, 0, 0),
            event(3, 0, 0, 0, 0, 0),
            event(4, 4, 0, 0, 0, 0),
            event(5, 4, 1, 0, 0, 0),
        ];
        let mut u = UnmatchedFrees::new(None);
        let mut analyzer = Analyzer::new(|_: &Origin| 0);
        for e in &events {
            u.push(e);
            analyzer.push(e);
        }
        u.finish();
        analyzer.finish();
        assert_eq!(analyzer.unmatched_by_pid.get(&2), None);
        assert_eq!(u.by_pid.get(&2), None);
    }
}
