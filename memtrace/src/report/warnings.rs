//! Under-counting said out loud: per process, when a good share of its frees had no
//! allocation (it was traced mid-run, or its allocator was probed after it started) or of
//! its allocations have a stack cut short (code without unwind information, frame pointers
//! missing, no room for stack copies), a warning names the process and the likely cause.
//! And when a kernel stack taken from an earlier unwind of its path was caught differing
//! from an unwind. `report` (text and JSON `warnings`) and the end of `record` print the
//! same lines.
use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use memtrace_common::{Space, TaskEvent};

use crate::{
    analysis::unmatched::UnmatchedFrees,
    event::Event,
    recording::{self, Meta, Reader, Stats},
    units::percent,
};

/// Recordings larger than this are not analyzed again when `record` ends (it would take
/// long); `report` says the same.
const RECORD_END_ANALYSIS_LIMIT: u64 = 1 << 30;

/// Stack ids below this are tallied in a vector (64 MB at most).
const MAX_DENSE_STACK_IDS: usize = 1 << 26;

/// The under-counting warnings of the recording `record` is finishing at `path`, for it to
/// repeat as it ends: read from the first `len` bytes, which hold every event and stack
/// definition (flushed), with the `stats` it will write after them, while `record` names
/// the frames and finishes the file (none when it cannot be read, or is too large to read
/// again quickly).
pub fn of_recording_so_far(path: &Path, len: u64, stats: &Stats) -> Vec<String> {
    if len > RECORD_END_ANALYSIS_LIMIT {
        return Vec::new();
    }
    tally(path, len, stats).unwrap_or_default()
}

/// What [`super::analyze`] counts for [`under_counting`] (its `under_counting`, the same
/// lines), without the rest of a report: the stacks' cuts but not their frames, no groups
/// of rows, no timeline. On the heavy Python bench's recording this pass takes a fraction
/// of a whole report's, most of which went to decoding and storing every stack's frames.
/// For a recording `record` is finishing: stacks' frames are not parsed, so a hand-made
/// file whose checksummed stacks chunk does not parse is judged past that chunk, where the
/// report stops at it. The chunks from `len` on (the frames' names, being written) are
/// not read.
fn tally(path: &Path, len: u64, stats: &Stats) -> anyhow::Result<Vec<String>> {
    // Definitions first, as the report reads them: a stack finished from a copy may be
    // defined after the events that refer to it.
    let mut reader = Reader::open(path)?;
    let meta = reader.meta.clone();
    // Whether each stack was cut, by id: ids are given in order from 0 (PyTorch's 1.25 M
    // stacks took 34 MB as a map, 1.25 MB as this); an id far past any recording's count
    // (a damaged or hand-made file) goes to a map.
    let mut cut: Vec<bool> = Vec::new();
    let mut cut_far: crate::FastMap<u32, bool> = Default::default();
    let mut damaged_at = Some(len);
    loop {
        let at = reader.offset();
        if at >= len {
            break;
        }
        let chunk = match reader.next_chunk_without_frames() {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            // Skipped, as the report skips it.
            Err(recording::FormatError::Damaged { .. }) => continue,
            Err(_) => {
                damaged_at = Some(at);
                break;
            }
        };
        // As events refer to them (id + 1); a later definition of an id replaces it.
        if let recording::Chunk::Stacks(stacks) = chunk {
            for s in &stacks {
                let id = s.id as usize;
                if id >= MAX_DENSE_STACK_IDS {
                    cut_far.insert(s.id, s.truncated);
                    continue;
                }
                if id >= cut.len() {
                    cut.resize(id + 1, false);
                }
                cut[id] = s.truncated;
            }
        }
    }
    let mut tallies: BTreeMap<u32, ProcessTally> = BTreeMap::new();
    let mut comms: HashMap<u32, String> = HashMap::new();
    let mut order = crate::lifecycle::Lifecycles::new();
    let mut user_allocs_seen = false;
    let no_room = no_room_stacks(stats);
    let unplaced = unplaced_stacks(stats);
    // The user heap paired as the report pairs it, keeping only addresses and times (no
    // groups, no kernel blocks: on PyTorch the report's pairing held 300 MB for this).
    let mut unmatched = UnmatchedFrees::new(stats.sampled_from.map(|(from, _)| from));
    super::load::for_each_event(path, damaged_at, &mut |event| {
        match &event {
            Event::Task(t) => note_task(t, &mut comms, &mut tallies, &mut order),
            Event::Alloc(a) => {
                user_allocs_seen |= !a.kind.is_kernel();
                if a.stack != 0 {
                    let t = tallies.entry(a.pid).or_default();
                    let id = a.stack - 1;
                    let was_cut = match cut.get(id as usize) {
                        Some(&c) => c,
                        None => u32::try_from(id).ok().and_then(|id| cut_far.get(&id)).copied().unwrap_or(false),
                    };
                    let domain = if a.kind.is_kernel() { &mut t.kernel } else { &mut t.user };
                    domain.count(a.stack, was_cut, &no_room, &unplaced);
                }
            }
            Event::Free(f) if f.kind.space() == Space::Heap => {
                tallies.entry(f.pid).or_default().frees += 1;
            }
            _ => {}
        }
        unmatched.push(&event);
    })?;
    unmatched.finish();
    for (pid, n) in &unmatched.by_pid {
        tallies.entry(*pid).or_default().unmatched_frees = *n;
    }
    let mut out = under_counting(&tallies, &comms, &meta, stats, Reading::default());
    if meta.user && meta.mode == "command" && !user_allocs_seen {
        out.push(nothing_seen(&meta));
    }
    Ok(out)
}

/// A process's name and whether it started while traced, from its main thread's task
/// events (the report's and `record`'s end-of-run warnings name processes alike). A
/// record older than what `order` knows of its process (a fork read from its parent's
/// CPU's ring after the child's exec was written) does not name it: the child read as its
/// parent (`sort` as the script that ran it), and `--comm` lost what it did after.
pub fn note_task(
    t: &crate::event::Task,
    comms: &mut HashMap<u32, String>,
    tallies: &mut BTreeMap<u32, ProcessTally>,
    order: &mut crate::lifecycle::Lifecycles,
) {
    if t.tid != t.pid {
        return;
    }
    match t.event {
        TaskEvent::Exec | TaskEvent::Fork if order.began(t.pid, t.ts_ns) => {
            comms.insert(t.pid, t.comm.clone());
        }
        TaskEvent::Rename if order.is_news(t.pid, t.ts_ns) => {
            comms.insert(t.pid, t.comm.clone());
        }
        // A process that was never named otherwise: its name as it exits.
        TaskEvent::Exit => {
            if t.flags & memtrace_common::flags::GROUP_DEAD != 0 {
                order.ended(t.pid, t.ts_ns);
            }
            comms.entry(t.pid).or_insert_with(|| t.comm.clone());
        }
        _ => {}
    }
    // Only a fork says so: a process forked before tracing began that execs while traced
    // (a subshell's last command, exec'd in place) was running before, and its frees of
    // blocks from then are those of a process attached mid-run. (A command's own process
    // is told apart by the recording's target.)
    if t.event == TaskEvent::Fork {
        tallies.entry(t.pid).or_default().started_traced = true;
    }
}

/// A command traced for its user allocations that made none memtrace could see.
pub fn nothing_seen(meta: &Meta) -> String {
    let program = meta.target_command.first().map_or("the command", String::as_str);
    let allocator = meta.allocator.as_deref().unwrap_or("the C allocator");
    format!(
        "no user-space allocation was recorded: {program} made no call to {allocator}'s malloc family (it may \
         not allocate at all, or manage its own heap, as Go programs do, where memtrace cannot see); record with \
         --no-user to trace its kernel allocations alone"
    )
}

/// Below this share, losses are noise (the C library freeing what it allocated before
/// `main`, a stack or two in hand-written assembly).
const SHARE: f64 = 0.05;
/// Fewer events than this are not enough to judge a share.
const MIN_EVENTS: u64 = 20;

/// What one process's events say about how completely it was seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessTally {
    /// Its user allocations' stacks.
    pub user: CutShort,
    /// The user part of its kernel allocations' stacks (the code that made the system call
    /// or took the page fault).
    pub kernel: CutShort,
    /// User heap frees, and of those, frees of blocks whose allocation was not seen.
    pub frees: u64,
    pub unmatched_frees: u64,
    /// Its fork was recorded: it started while traced.
    pub started_traced: bool,
}

/// Allocations recorded with a stack, and of those, stacks cut short: for want of ring
/// room for a stack copy, and at a frame in no file memtrace could read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutShort {
    pub with_stack: u64,
    pub truncated: u64,
    pub no_room: u64,
    pub unplaced: u64,
}

impl CutShort {
    /// One more allocation with stack `stack` (id + 1), `cut` short or not.
    pub fn count(&mut self, stack: u64, cut: bool, no_room: &crate::FastSet<u64>, unplaced: &crate::FastSet<u64>) {
        self.with_stack += 1;
        self.truncated += u64::from(cut);
        self.no_room += u64::from(cut && no_room.contains(&stack));
        self.unplaced += u64::from(cut && unplaced.contains(&stack));
    }

    /// Past the share where losses are more than noise.
    fn worth_a_warning(&self) -> bool {
        self.with_stack >= MIN_EVENTS && self.truncated as f64 >= SHARE * self.with_stack as f64
    }

    fn share(&self) -> String {
        percent(100.0 * self.truncated as f64 / self.with_stack as f64)
    }
}

/// The stacks cut short for want of ring room for a copy, as events refer to them (id + 1).
pub fn no_room_stacks(stats: &Stats) -> crate::FastSet<u64> {
    stats.unwind_no_room_stacks.iter().map(|&id| u64::from(id) + 1).collect()
}

/// The stacks cut short at a frame in no file, as events refer to them (id + 1).
pub fn unplaced_stacks(stats: &Stats) -> crate::FastSet<u64> {
    stats.unwind_unplaced_stacks.iter().map(|&id| u64::from(id) + 1).collect()
}

/// How the recording was read, for [`under_counting`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Reading {
    /// Damaged chunks were skipped.
    pub skipped: bool,
    /// The report's filters keep some allocations out of its columns (the tallies count
    /// them all).
    pub filtered: bool,
}

/// The warnings for these processes (pid → tally), named with `comms`.
pub fn under_counting(
    tallies: &BTreeMap<u32, ProcessTally>,
    comms: &HashMap<u32, String>,
    meta: &Meta,
    stats: &Stats,
    reading: Reading,
) -> Vec<String> {
    let mut out = Vec::new();
    if stats.kernel_stacks_differed > 0 {
        out.push(format!(
            "{} kernel stacks taken from an earlier unwind of their path differed from an unwind when checked: up to \
             {} kernel stacks before each of them may name the wrong callers (those paths are always unwound since; \
             MEMTRACE_KERNEL_STACK_REUSE=off unwinds every one)",
            stats.kernel_stacks_differed,
            memtrace_common::KSTACK_CHECK_EVERY - 1
        ));
    }
    if stats.user_walks_interleaved > 0 {
        out.push(format!(
            "{} user stacks keep their call site alone (cut short): another program ran on the CPU while their \
             walk did, over the same working memory (a thread preempted inside a probe, on a kernel that preempts \
             kernel code, or a kernel allocation traced in an interrupt)",
            stats.user_walks_interleaved
        ));
    }
    if stats.mremaps_unlooked > 0 {
        out.push(format!(
            "{} mremap calls could not look up the mapping they moved (the process's memory map was locked for \
             writing): their new mappings are counted as memory, whatever they were (a file's read-only view is \
             not memory, a PROT_NONE reservation is reserved)",
            stats.mremaps_unlooked
        ));
    }
    let name_of = |pid: u32| match comms.get(&pid) {
        Some(comm) => format!("process {comm} [{pid}]"),
        None => format!("process {pid}"),
    };
    for a in &stats.allocators {
        let Some(late) = a.probed_late.as_ref().filter(|l| l.exec) else { continue };
        // Only what this session kept for the next: not a program that preloads its
        // allocator, nor without the disk cache. (Recordings before the program was kept
        // name none, and promised it for every command.)
        let again = if meta.mode == "command" && (late.remembered || late.program.is_empty()) {
            "; the next `record` of this command probes it from the start (remembered beside the unwind cache)"
        } else {
            ""
        };
        // The allocator is the program's own, or in a library it links or preloads.
        let whose = if late.program.is_empty() || late.program == a.module {
            format!("{}, whose allocator ({})", a.module, a.family)
        } else {
            format!("{}, whose allocator ({}, {})", late.program, a.family, a.module)
        };
        out.push(format!(
            "{} exec'd {whose} was probed {} after the exec: the calls it made to it before then are not in the \
             recording{again}",
            name_of(late.pid),
            crate::units::duration(late.after_ns)
        ));
    }
    for (&pid, t) in tallies {
        let name = name_of(pid);
        if t.frees >= MIN_EVENTS && t.unmatched_frees as f64 >= SHARE * t.frees as f64 {
            let cause = if t.started_traced || (meta.target_pids.contains(&pid) && meta.mode == "command") {
                "its allocator was probed after it started (a child or an exec'd program with its own allocator is \
                 probed milliseconds after it appears, an allocator loaded with dlopen within 2 s): its first \
                 allocations were missed"
            } else {
                "it was already running when tracing began (attached mid-run): blocks allocated before are freed \
                 without their allocation, and live figures miss them"
            };
            // A damaged chunk skipped may have held them (its kind is not known): both said.
            let cause = match reading.skipped {
                true => format!(
                    "a damaged part of the recording was skipped, and the allocations it held with it (see above); \
                     or {cause}"
                ),
                false => cause.to_string(),
            };
            // (Filtered, the FREES column counts fewer: only those the filters keep.)
            let column = match reading.filtered {
                false => format!(
                    "; the report's FREES column counts the other {}",
                    t.frees.saturating_sub(t.unmatched_frees)
                ),
                true => String::new(),
            };
            out.push(format!(
                "{name}: {} of its frees ({} of {}{column}) had no allocation: {cause}",
                percent(100.0 * t.unmatched_frees as f64 / t.frees as f64),
                t.unmatched_frees,
                t.frees,
            ));
        }
        let user = t.user.worth_a_warning().then(|| cut_short_cause(&t.user, meta, stats));
        let kernel = t.kernel.worth_a_warning().then(|| cut_short_cause(&t.kernel, meta, stats));
        if user.is_none() && kernel.is_none() {
            continue;
        }
        let (u, k) = (&t.user, &t.kernel);
        let user_part = format!("{} of its allocations ({} of {})", u.share(), u.truncated, u.with_stack);
        let kernel_part =
            format!("{} of its kernel allocations ({} of {}) in the user part", k.share(), k.truncated, k.with_stack);
        match (user, kernel) {
            // One cause for both: one line.
            (Some(u), Some(k)) if u == k => {
                out.push(format!("{name}: {user_part}, and {kernel_part}, have a stack cut short: {u}"))
            }
            (u, k) => {
                if let Some(u) = u {
                    out.push(format!("{name}: {user_part} have a stack cut short: {u}"));
                }
                if let Some(k) = k {
                    out.push(format!("{name}: {kernel_part} have a stack cut short: {k}"));
                }
            }
        }
    }
    out
}

/// Why `c`'s stacks were cut short, as far as the recording tells.
fn cut_short_cause(c: &CutShort, meta: &Meta, stats: &Stats) -> String {
    let no_unwind_info = format!(
        "code without unwind information (JIT-compiled or hand-written assembly), or stacks deeper than {} \
         frames",
        memtrace_common::MAX_USER_DEPTH
    );
    let room = "the rings had no room for stack copies while unwind rules were learned (a larger \
                --ring-size keeps those)";
    // Told per stack since the recordings list them; before, or past the list's
    // bound, only the session's count is known: both causes are named.
    let listed = !stats.unwind_no_room_stacks.is_empty()
        && (stats.unwind_no_room_stacks.len() < recording::MAX_NO_ROOM_STACKS || c.no_room == c.truncated);
    let unplaced = "frames in code memtrace found in no file (JIT-compiled code, or a program or library \
                    gone, in another mount namespace or in memory only before memtrace read it)";
    let unplaced_listed = !stats.unwind_unplaced_stacks.is_empty()
        && (stats.unwind_unplaced_stacks.len() < recording::MAX_NO_ROOM_STACKS || c.unplaced == c.truncated);
    if meta.call_graph != "dwarf" {
        "code built without frame pointers stops a frame-pointer walk: record with --call-graph dwarf".to_string()
    } else if unplaced_listed && c.unplaced == c.truncated {
        unplaced.to_string()
    } else if unplaced_listed && c.unplaced > 0 && c.no_room == 0 {
        format!("for {} of them, {unplaced}; for the others, {no_unwind_info}", c.unplaced)
    } else if listed && c.no_room == c.truncated {
        room.to_string()
    } else if listed && c.no_room > 0 {
        format!("for {} of them, {room}; for the others, {no_unwind_info}", c.no_room)
    } else if stats.unwind_budget_truncated > 0 && !listed {
        format!(
            "{no_unwind_info}; or no room in the rings for stack copies while unwind rules were learned, \
             which cut short {} stacks of the session (a larger --ring-size keeps those)",
            stats.unwind_budget_truncated
        )
    } else {
        no_unwind_info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process started while traced when its fork was recorded; an exec alone (a
    /// subshell running its last command in place under `-a`) does not say so.
    #[test]
    fn only_a_fork_says_a_process_started_while_traced() {
        let task = |event, pid| crate::event::Task {
            ts_ns: 1,
            event,
            flags: 0,
            pid,
            tid: pid,
            ppid: 1,
            comm: "tar".into(),
            filename: String::new(),
        };
        let (mut comms, mut tallies, mut order) = (HashMap::new(), BTreeMap::new(), Default::default());
        note_task(&task(TaskEvent::Exec, 7), &mut comms, &mut tallies, &mut order);
        assert!(!tallies.get(&7).is_some_and(|t: &ProcessTally| t.started_traced));
        assert_eq!(comms[&7], "tar");
        note_task(&task(TaskEvent::Fork, 8), &mut comms, &mut tallies, &mut order);
        assert!(tallies[&8].started_traced);
    }

    /// A fork written after its child's exec (read a drain late, from the parent's CPU's
    /// ring) says the child started while traced, but does not name it after its parent.
    #[test]
    fn a_fork_read_after_the_exec_does_not_rename_the_child() {
        let task = |event, ts_ns, comm: &str| crate::event::Task {
            ts_ns,
            event,
            flags: 0,
            pid: 9,
            tid: 9,
            ppid: 1,
            comm: comm.into(),
            filename: String::new(),
        };
        let (mut comms, mut tallies, mut order) = (HashMap::new(), BTreeMap::new(), Default::default());
        note_task(&task(TaskEvent::Exec, 20, "sort"), &mut comms, &mut tallies, &mut order);
        note_task(&task(TaskEvent::Fork, 10, "wl.sh"), &mut comms, &mut tallies, &mut order);
        assert_eq!(comms[&9], "sort");
        assert!(tallies[&9].started_traced);
        note_task(&task(TaskEvent::Rename, 15, "early"), &mut comms, &mut tallies, &mut order);
        assert_eq!(comms[&9], "sort", "a rename from before the exec");
        note_task(&task(TaskEvent::Rename, 30, "worker"), &mut comms, &mut tallies, &mut order);
        assert_eq!(comms[&9], "worker");
    }

    #[test]
    fn warnings_name_the_process_and_the_cause_past_a_few_percent() {
        let meta = Meta { mode: "all".into(), call_graph: "dwarf".into(), ..Default::default() };
        let comms = HashMap::from([(7, "server".to_string())]);
        let mut tallies = BTreeMap::new();
        tallies.insert(
            7,
            ProcessTally {
                frees: 1000,
                unmatched_frees: 200,
                user: CutShort { with_stack: 1000, truncated: 10, ..Default::default() },
                ..Default::default()
            },
        );
        tallies.insert(
            8,
            ProcessTally {
                frees: 1000,
                unmatched_frees: 20,
                user: CutShort { with_stack: 1000, truncated: 400, ..Default::default() },
                started_traced: true,
                ..Default::default()
            },
        );
        tallies.insert(9, ProcessTally { frees: 10, unmatched_frees: 10, ..Default::default() });
        let w = under_counting(&tallies, &comms, &meta, &Stats::default(), Reading::default());
        assert_eq!(w.len(), 2, "{w:#?}");
        assert!(
            w[0].starts_with(
                "process server [7]: 20.0% of its frees (200 of 1000; the report's FREES column counts the other 800) \
                 had no allocation"
            ),
            "{}",
            w[0]
        );
        assert!(w[0].contains("attached mid-run"), "{}", w[0]);
        assert!(
            w[1].starts_with("process 8: 40.0% of its allocations (400 of 1000) have a stack cut short"),
            "{}",
            w[1]
        );
        assert!(w[1].contains("without unwind information"), "{}", w[1]);
        let fp = Meta { call_graph: "fp".into(), ..meta.clone() };
        assert!(
            under_counting(&tallies, &comms, &fp, &Stats::default(), Reading::default())[1]
                .contains("--call-graph dwarf")
        );
        // Copies refused for want of ring room, in a recording that does not list their
        // stacks: counted for the session, not per process, and that cause is named beside
        // the other, with the session's count.
        let budget = Stats { unwind_budget_truncated: 17, ..Default::default() };
        let w = under_counting(&tallies, &comms, &meta, &budget, Reading::default());
        assert!(w[1].contains("without unwind information") && w[1].contains("cut short 17 stacks of the session"));
        // Listed: each process's share is told.
        let listed = Stats { unwind_budget_truncated: 17, unwind_no_room_stacks: vec![3], ..Default::default() };
        // Process 8's warning, with `set` applied to its tally, under `stats`.
        let cause_of = |stats: &Stats, set: &dyn Fn(&mut ProcessTally)| {
            let mut tallies = tallies.clone();
            set(tallies.get_mut(&8).unwrap());
            under_counting(&tallies, &comms, &meta, stats, Reading::default())[1].clone()
        };
        let no_room = |n: u64| cause_of(&listed, &move |t: &mut ProcessTally| t.user.no_room = n);
        let all = no_room(400);
        assert!(all.ends_with("cut short: the rings had no room for stack copies while unwind rules were learned (a larger --ring-size keeps those)"), "{all}");
        let some = no_room(100);
        assert!(
            some.contains("for 100 of them, the rings had no room")
                && some.contains("for the others, code without unwind information"),
            "{some}"
        );
        let none = no_room(0);
        assert!(
            none.contains("have a stack cut short: code without unwind information") && !none.contains("ring"),
            "{none}"
        );
        // Cut at a frame in no file (the program's file gone before it was read): that
        // cause, not missing unwind information (helper-44).
        let unplaced = Stats { unwind_unplaced_stacks: vec![4], ..Default::default() };
        let unplaced_by = |n: u64| cause_of(&unplaced, &move |t: &mut ProcessTally| t.user.unplaced = n);
        let all = unplaced_by(400);
        assert!(all.contains("cut short: frames in code memtrace found in no file"), "{all}");
        assert!(!all.contains("without unwind information"), "{all}");
        let some = unplaced_by(100);
        assert!(
            some.contains("for 100 of them, frames in code memtrace found in no file")
                && some.contains("for the others, code without unwind information"),
            "{some}"
        );
        // The user part of kernel allocations' stacks (a compiler's page faults while
        // its tables were built): a line of its own; with the user stacks' cause, one.
        let kernel_cut = CutShort { with_stack: 10_501, truncated: 1_298, no_room: 1_298, unplaced: 0 };
        let mut with_kernel = BTreeMap::new();
        with_kernel.insert(7, ProcessTally { kernel: kernel_cut, ..Default::default() });
        let w = under_counting(&with_kernel, &comms, &meta, &listed, Reading::default());
        assert_eq!(
            w,
            [format!(
                "process server [7]: 12.4% of its kernel allocations (1298 of 10501) in the user part have a stack \
                 cut short: {}",
                cut_short_cause(&kernel_cut, &meta, &listed)
            )]
        );
        assert!(w[0].ends_with("the rings had no room for stack copies while unwind rules were learned (a larger --ring-size keeps those)"), "{}", w[0]);
        with_kernel.get_mut(&7).unwrap().user = CutShort { with_stack: 100, truncated: 100, ..Default::default() };
        let w = under_counting(&with_kernel, &comms, &fp, &listed, Reading::default());
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(
            w[0].starts_with(
                "process server [7]: 100.0% of its allocations (100 of 100), and 12.4% of its kernel allocations \
                 (1298 of 10501) in the user part, have a stack cut short: code built without frame pointers"
            ),
            "{}",
            w[0]
        );
        let w = under_counting(&with_kernel, &comms, &meta, &listed, Reading::default());
        assert_eq!(w.len(), 2, "{w:#?}");
        assert!(
            w[0].contains("100.0% of its allocations (100 of 100) have a stack cut short: code without"),
            "{}",
            w[0]
        );
        assert!(w[1].contains("12.4% of its kernel allocations"), "{}", w[1]);
        tallies
            .insert(7, ProcessTally { frees: 1000, unmatched_frees: 200, started_traced: true, ..Default::default() });
        assert!(
            under_counting(&tallies, &comms, &meta, &Stats::default(), Reading::default())[0]
                .contains("probed after it started")
        );
        // A chunk of the recording skipped is named the cause: the allocations went with it.
        let w = under_counting(&tallies, &comms, &meta, &Stats::default(), Reading { skipped: true, filtered: false });
        assert!(w[0].contains("a damaged part of the recording was skipped"), "{}", w[0]);
        // Unfiltered, the FREES column counts the other frees; filtered, it counts fewer.
        assert!(w[0].contains("(200 of 1000; the report's FREES column counts the other 800)"), "{}", w[0]);
        let w = under_counting(&tallies, &comms, &meta, &Stats::default(), Reading { filtered: true, skipped: false });
        assert!(w[0].contains("(200 of 1000) had no allocation"), "{}", w[0]);
        let differed = Stats { kernel_stacks_differed: 2, ..Default::default() };
        let w = under_counting(&BTreeMap::new(), &comms, &meta, &differed, Reading::default());
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(w[0].starts_with("2 kernel stacks taken from an earlier unwind"), "{}", w[0]);
        let interleaved = Stats { user_walks_interleaved: 5, ..Default::default() };
        let w = under_counting(&BTreeMap::new(), &comms, &meta, &interleaved, Reading::default());
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(w[0].starts_with("5 user stacks keep their call site alone (cut short)"), "{}", w[0]);
        let unlooked = Stats { mremaps_unlooked: 3, ..Default::default() };
        let w = under_counting(&BTreeMap::new(), &comms, &meta, &unlooked, Reading::default());
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(w[0].starts_with("3 mremap calls could not look up the mapping they moved"), "{}", w[0]);
        // An allocator probed after the program that brought it began: said for an exec'd
        // program's own; a library's mapped earlier is said on its allocator line.
        let allocator = |exec| recording::AllocatorMeta {
            module: "/usr/bin/rustc".into(),
            family: "jemalloc".into(),
            probed_late: Some(recording::LateProbe { pid: 7, after_ns: 551_000_000, exec, ..Default::default() }),
            ..Default::default()
        };
        let late = Stats { allocators: vec![allocator(true), allocator(false)], ..Default::default() };
        let w = under_counting(&BTreeMap::new(), &comms, &meta, &late, Reading::default());
        assert_eq!(w.len(), 1, "{w:#?}");
        assert_eq!(
            w[0],
            "process server [7] exec'd /usr/bin/rustc, whose allocator (jemalloc) was probed 551.0ms after the exec: \
             the calls it made to it before then are not in the recording"
        );
        let command = Meta { mode: "command".into(), ..meta.clone() };
        assert!(
            under_counting(&BTreeMap::new(), &comms, &command, &late, Reading::default())[0]
                .contains("the next `record`")
        );
        // A library's allocator that came with an exec'd program: the program is named, and
        // the next record is promised only where the session kept the program for it (not
        // under LD_PRELOAD, nor without the disk cache).
        let preloaded = |remembered| recording::AllocatorMeta {
            module: "/usr/lib/libjemalloc.so.2".into(),
            family: "jemalloc".into(),
            probed_late: Some(recording::LateProbe {
                pid: 7,
                after_ns: 2_000_000,
                exec: true,
                program: "/usr/bin/ls".into(),
                remembered,
            }),
            ..Default::default()
        };
        for remembered in [false, true] {
            let late = Stats { allocators: vec![preloaded(remembered)], ..Default::default() };
            let w = under_counting(&BTreeMap::new(), &comms, &command, &late, Reading::default());
            assert!(
                w[0].starts_with(
                    "process server [7] exec'd /usr/bin/ls, whose allocator (jemalloc, /usr/lib/libjemalloc.so.2) was \
                     probed 2.0ms after the exec"
                ),
                "{}",
                w[0]
            );
            assert_eq!(w[0].contains("the next `record`"), remembered, "{}", w[0]);
        }
    }
}
