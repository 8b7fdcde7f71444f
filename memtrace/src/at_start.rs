//! What every process was when a `record -a` session began: its executable mappings and
//! its name, read from /proc once the probes are attached (perf's synthesized mmap events).
//!
//! Without it, a process already running was learned from /proc when its first record was
//! read, and by then it may have exec'd: a shell whose last command replaces it (`bash -c
//! '…; sleep 1'`) had its stacks before the exec walked and named in `sleep`'s maps, every
//! one cut short at a first frame `[unknown]` (250 of 452 in a test run whose reader fell
//! behind), and its allocations under the name `sleep`. Each consumer (the unwinder, the
//! namer of frames) keeps a [`StartView`]: a process's entry holds until that consumer sees
//! it exec, fork into its pid, or exit; its maps are taken once (a later read is /proc's).
use std::sync::Arc;

use crate::{
    FastMap, FastSet,
    procfs::{self, Maps},
};

/// One process as the snapshot found it.
#[derive(Debug, Clone)]
pub struct Process {
    /// Its executable mappings (what frames point into).
    pub maps: Maps,
    pub comm: String,
    /// When its maps were read (CLOCK_MONOTONIC, as the probes' stamps).
    pub read_ns: u64,
}

/// Every process with an address space when the snapshot was taken.
#[derive(Debug, Default)]
pub struct Snapshot {
    processes: FastMap<u32, Process>,
}

impl Snapshot {
    /// Reads every process's executable mappings and name (kernel threads, with none, and
    /// processes gone meanwhile are left out; `except` too: memtrace itself), on a few
    /// threads: 625 processes took 56 ms on one (the kernel formats each `maps` file).
    pub fn take(except: u32) -> Self {
        let pids: Vec<u32> = std::fs::read_dir("/proc")
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                    .filter(|&pid| pid != except)
                    .collect()
            })
            .unwrap_or_default();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
        let share = pids.len().div_ceil(threads).max(1);
        let processes = std::thread::scope(|scope| {
            let readers: Vec<_> = pids
                .chunks(share)
                .map(|chunk| scope.spawn(move || chunk.iter().filter_map(|&pid| read(pid)).collect::<Vec<_>>()))
                .collect();
            readers.into_iter().flat_map(|r| r.join().unwrap_or_default()).collect()
        });
        Self { processes }
    }

    /// A snapshot of the given processes (tests).
    pub fn of(processes: impl IntoIterator<Item = (u32, Process)>) -> Self {
        Self { processes: processes.into_iter().collect() }
    }

    /// `pid`'s name when the session began.
    pub fn comm(&self, pid: u32) -> Option<&str> {
        self.processes.get(&pid).map(|p| p.comm.as_str())
    }

    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    /// Executable mappings in all (what the snapshot costs in memory, roughly 100 bytes each).
    pub fn mappings(&self) -> usize {
        self.processes.values().map(|p| p.maps.mappings.len()).sum()
    }
}

/// Process `pid` now, if it has code mapped.
fn read(pid: u32) -> Option<(u32, Process)> {
    let read_ns = crate::session::monotonic_ns();
    let mut maps = Maps::read(pid).ok()?;
    maps.mappings.retain(|m| m.executable);
    if maps.mappings.is_empty() {
        return None;
    }
    let comm = procfs::comm(pid, pid)?;
    Some((pid, Process { maps, comm, read_ns }))
}

/// One consumer's use of a [`Snapshot`]: what still holds for it.
#[derive(Debug, Default)]
pub struct StartView {
    snapshot: Option<Arc<Snapshot>>,
    /// Processes seen changing (exec, a fork into the pid, exit) since the snapshot.
    changed: FastSet<u32>,
    /// Processes whose maps were taken.
    taken: FastSet<u32>,
}

impl StartView {
    pub fn new(snapshot: Arc<Snapshot>) -> Self {
        Self { snapshot: Some(snapshot), ..Self::default() }
    }

    fn get(&self, pid: u32) -> Option<&Process> {
        if self.changed.contains(&pid) {
            return None;
        }
        self.snapshot.as_ref()?.processes.get(&pid)
    }

    /// `pid`'s maps when the session began, and when they were read, the first time they
    /// are asked for while they hold (None after: read /proc).
    pub fn take_maps(&mut self, pid: u32) -> Option<(Maps, u64)> {
        let p = self.get(pid)?;
        let found = (p.maps.clone(), p.read_ns);
        self.taken.insert(pid).then_some(found)
    }

    /// `pid` exec'd, was forked anew, or exited: the snapshot no longer says what it is.
    pub fn changed(&mut self, pid: u32) {
        if self.snapshot.as_ref().is_some_and(|s| s.processes.contains_key(&pid)) {
            self.changed.insert(pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_gives_a_process_maps_once_and_none_once_it_changed() {
        let maps = Maps { mappings: Vec::new() };
        let p = |read_ns| Process { maps: maps.clone(), comm: "sh".into(), read_ns };
        let snapshot = Arc::new(Snapshot::of([(1, p(10)), (2, p(20))]));
        assert_eq!((snapshot.len(), snapshot.comm(2), snapshot.comm(3)), (2, Some("sh"), None));
        let mut view = StartView::new(snapshot.clone());
        assert_eq!(view.take_maps(1).map(|(_, at)| at), Some(10));
        assert!(view.take_maps(1).is_none(), "taken once: a later read is /proc's");
        view.changed(2);
        assert!(view.take_maps(2).is_none(), "it exec'd, forked anew or exited");
        assert!(view.take_maps(3).is_none());
        // Each consumer has its own view.
        assert!(StartView::new(snapshot).take_maps(2).is_some());
        assert!(StartView::default().take_maps(1).is_none());
    }

    #[test]
    fn the_snapshot_has_this_machine_s_processes_but_the_one_left_out() {
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        let snapshot = Snapshot::take(me);
        assert!(snapshot.comm(me).is_none());
        // (The test harness's parent, cargo or a shell, has code mapped.)
        assert!(snapshot.comm(parent).is_some(), "{parent} not in a snapshot of {} processes", snapshot.len());
        assert!(snapshot.mappings() >= snapshot.len());
    }
}
