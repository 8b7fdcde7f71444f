//! Unit tests of `serve` without BPF: the model's pairing, scaling, bounds and process
//! lifecycle; cardinality bounding and monotonic counters; the exposition formats; query
//! parsing and the profiles (decoded with prost); the command line; the HTTP server's
//! answers, limits and timeouts; the deploy files.
//!
//! Over 500 lines: tests only.
use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Parser;
use memtrace_common::{Kind, TaskEvent, flags};

#[path = "../../tests/common/pprof.rs"]
mod pprof_messages;

use super::{
    Shared,
    cgroup::Cgroup,
    config::{Config, HttpConfig, ServeArgs, parse_listen, read_token},
    http::Server,
    metrics::{self, Group, MetricsState, Row},
    model::{EXITED_MAX_AGE, Limits, Model, Pending, Scraper, SiteKey, SiteStats, StackRef},
    names::{Names, site_label},
    profile::{self, ProfileKind, ProfileQuery, parse_query},
};
use crate::{
    analysis::Domain,
    event::{Alloc, Event, Free, RawUserFrame, StackRecord, Task, UserWalk},
    recording::{FileFrame, FileStack, Module, Symbol, SymbolKey},
    session::{Sink, Target},
};

/// A pid no process has (pid_max is at most 2^22).
const GONE: u32 = 4_194_390;

fn limits() -> Limits {
    Limits { max_live_blocks: 1000, max_stacks: 1000, sample_bytes: None }
}

fn alloc(pid: u32, kind: Kind, ptr: u64, size: u64, stack: u64, ts: u64) -> Event {
    Event::Alloc(Alloc {
        ts_ns: ts,
        pid,
        tid: pid,
        cpu: 0,
        kind,
        flags: 0,
        ptr,
        bytes_req: size,
        bytes_alloc: size + 8,
        stack,
        call_site: if kind.is_kernel() { 0xffff_ffff_8100_0000 } else { 0 },
        gfp_flags: 0,
        node: -1,
        order: 0,
        allocator: 0,
        cache: 0,
    })
}

fn free(pid: u32, kind: Kind, ptr: u64, arg: u32) -> Event {
    Event::Free(Free { ts_ns: 0, pid, tid: pid, cpu: 0, kind, flags: 0, ptr, arg })
}

fn task(pid: u32, event: TaskEvent, flags: u8) -> Event {
    Event::Task(Task {
        ts_ns: 0,
        event,
        flags,
        pid,
        tid: pid,
        ppid: 1,
        comm: "renamed".into(),
        filename: String::new(),
    })
}

fn stats(m: &mut Model, pid: u32) -> Vec<(SiteKey, SiteStats)> {
    let snap = m.snapshot(Scraper::Heap);
    let mut v: Vec<(SiteKey, SiteStats)> =
        snap.sites.iter().filter(|s| snap.processes[s.process].pid == pid).map(|s| (s.key, s.stats)).collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

#[test]
fn the_model_pairs_frees_with_their_sites() {
    let mut m = Model::new(limits());
    m.event(alloc(GONE, Kind::Malloc, 0x10, 100, 0xaaa, 1));
    m.event(alloc(GONE, Kind::Malloc, 0x20, 50, 0xaaa, 2));
    m.event(alloc(GONE, Kind::Calloc, 0x30, 7, 0xbbb, 3));
    m.event(free(GONE, Kind::Free, 0x10, 0));
    m.event(free(GONE, Kind::Free, 0x999, 0)); // allocated before tracing
    let s = stats(&mut m, GONE);
    assert_eq!(s.len(), 2);
    let (a, b) = (&s[0].1, &s[1].1);
    assert_eq!((a.allocs, a.bytes_req, a.bytes_alloc, a.live_allocs, a.live_bytes_req), (2, 150, 166, 1, 50));
    assert_eq!((b.allocs, b.live_allocs, b.live_bytes_alloc, b.wasted()), (1, 1, 15, 8));
    assert_eq!(s[0].0.stack, StackRef(1), "the first stack interned is id 0");
    assert_eq!(m.counters.unmatched_frees, 1);
    assert_eq!(m.usage().live_blocks, 2);
    // A forked child frees its copy of a parent's block: the parent's stays live.
    let mut fork = task(GONE + 1, TaskEvent::Fork, 0);
    if let Event::Task(t) = &mut fork {
        t.ppid = GONE;
    }
    m.event(fork);
    m.event(free(GONE + 1, Kind::Free, 0x20, 0));
    m.event(free(GONE + 1, Kind::Free, 0x998, 0));
    assert_eq!((m.counters.inherited_frees, m.counters.unmatched_frees), (1, 2));
    assert_eq!(m.usage().live_blocks, 2);
    // An allocation at a live address: the earlier block's free was missed.
    m.event(alloc(GONE, Kind::Malloc, 0x20, 10, 0xaaa, 4));
    let s = stats(&mut m, GONE);
    assert_eq!((s[0].1.live_allocs, s[0].1.live_bytes_req, s[0].1.allocs), (1, 10, 3));
}

#[test]
fn kernel_blocks_are_freed_by_anyone_and_mmaps_by_range() {
    let mut m = Model::new(limits());
    m.event(alloc(GONE, Kind::Kmalloc, 0xffff_1000, 64, 0, 1));
    m.event(free(GONE + 1, Kind::Kfree, 0xffff_1000, 0));
    m.event(alloc(GONE, Kind::Mmap, 0x7000_0000, 8192, 0, 2));
    m.event(alloc(GONE, Kind::Mmap, 0x7000_2000, 4096, 0, 3));
    m.event(alloc(GONE, Kind::Mmap, 0x7100_0000, 4096, 0, 4));
    m.event(free(GONE, Kind::Munmap, 0x7000_0000, 3)); // three pages: the first two regions
    let s = stats(&mut m, GONE);
    let kernel = s.iter().find(|(k, _)| k.kind == Kind::Kmalloc).unwrap().1;
    assert_eq!((kernel.allocs, kernel.live_allocs), (1, 0));
    let mmap = s.iter().find(|(k, _)| k.kind == Kind::Mmap).unwrap().1;
    assert_eq!((mmap.allocs, mmap.live_allocs, mmap.live_bytes_req), (3, 1, 4096));
    assert_eq!(m.usage().live_blocks, 1);
    // A kernel site is named by its call site when there is no stack.
    let snap = m.snapshot(Scraper::Metrics);
    let site = snap.sites.iter().find(|s| s.key.kind == Kind::Kmalloc).unwrap();
    assert_eq!(site.key.call_site, 0xffff_ffff_8100_0000);
    assert_eq!(site.key.domain(), Domain::Kernel);
}

#[test]
fn sampled_allocations_are_scaled_back() {
    let mut m = Model::new(Limits { sample_bytes: Some(1024), max_live_blocks: 1 << 20, max_stacks: 10 });
    let n = 20_000u64;
    for i in 0..n {
        m.event(alloc(GONE, Kind::Malloc, 0x1000 + i * 16, 100, 0xaaa, i * 7919));
    }
    m.event(alloc(GONE, Kind::Kmalloc, 0xffff_0000, 100, 0, 1));
    let s = stats(&mut m, GONE);
    let user = s.iter().find(|(k, _)| k.kind == Kind::Malloc).unwrap().1;
    // Each sampled 100-byte block stands for 1/(1 - e^(-100/1024)) of them.
    let want = n as f64 / -(-100f64 / 1024.0).exp_m1();
    assert!((user.allocs as f64 - want).abs() / want < 0.01, "{} vs {want}", user.allocs);
    assert_eq!(user.bytes_req, user.allocs * 100);
    assert_eq!(user.live_allocs, user.allocs);
    let kernel = s.iter().find(|(k, _)| k.kind == Kind::Kmalloc).unwrap().1;
    assert_eq!(kernel.allocs, 1, "kernel allocations are not sampled");
    assert_eq!((m.counters.allocations, m.counters.user_allocations), (n + 1, n));
}

#[test]
fn the_live_block_and_stack_tables_are_bounded() {
    let mut m = Model::new(Limits { max_live_blocks: 3, max_stacks: 2, sample_bytes: None });
    for i in 0..5 {
        m.event(alloc(GONE, Kind::Malloc, 0x10 * (i + 1), 10, 0x100 + i % 3, i));
    }
    assert_eq!(m.usage().live_blocks, 3);
    assert_eq!(m.counters.untracked, 2);
    assert_eq!(m.usage().stacks, 2);
    assert_eq!(m.counters.stacks_dropped, 1);
    let s = stats(&mut m, GONE);
    assert_eq!(s.iter().map(|(_, st)| st.allocs).sum::<u64>(), 5, "every allocation is counted");
    assert!(s.iter().any(|(k, _)| k.stack == StackRef::OVERFLOW));
    assert_eq!(site_label(Domain::User, Kind::Malloc, StackRef::OVERFLOW, &[]), "[stack table full]");
    assert_eq!(site_label(Domain::User, Kind::Calloc, StackRef::NONE, &[]), "[no stack: calloc]");
}

#[test]
fn exited_processes_stay_until_scraped_then_go_with_their_stacks() {
    let mut m = Model::new(limits());
    m.stack(StackRecord {
        hash: 0xaaa,
        pid: GONE,
        asid: 0,
        kernel: vec![],
        user: vec![RawUserFrame::Ip(0x1234)],
        walk: UserWalk::FramePointers,
        truncated: false,
        no_room: false,
        joined_kernel: false,
        miss: None,
        python_context: None,
        py_key: 0,
    });
    m.event(alloc(GONE, Kind::Malloc, 0x10, 100, 0xaaa, 1));
    m.event(alloc(GONE, Kind::Kmalloc, 0xffff_2000, 64, 0, 2));
    let pending = m.take_pending();
    assert_eq!(pending.stacks.len(), 1);
    assert_eq!(pending.call_sites, [0xffff_ffff_8100_0000]);
    // Somebody scrapes /metrics; then the process exits.
    m.snapshot(Scraper::Metrics);
    std::thread::sleep(Duration::from_millis(5));
    m.event(task(GONE, TaskEvent::Exit, flags::GROUP_DEAD));
    assert_eq!(m.usage().live_blocks, 1, "its heap went with it; the kernel block stays");
    let now = Instant::now();
    m.housekeep(now);
    assert_eq!((m.usage().processes, m.usage().exited), (0, 1), "kept for the next scrape");
    let snap = m.snapshot(Scraper::Metrics);
    assert!(snap.processes.iter().any(|p| p.pid == GONE && !p.alive));
    let user = snap.sites.iter().find(|s| s.key.kind == Kind::Malloc).unwrap();
    assert_eq!(user.stats.live_allocs, 1, "leaked at exit: shown once more");
    m.housekeep(Instant::now());
    assert_eq!(m.usage().exited, 0, "dropped after its last scrape");
    assert_eq!(m.usage().live_blocks, 0, "with its kernel blocks");
    assert_eq!(m.counters.processes_dropped, 1);
    // Its stack goes once nothing refers to it (after a grace period for late events).
    m.housekeep(Instant::now() + Duration::from_secs(61));
    assert_eq!(m.usage().stacks, 0);
    assert_eq!(m.take_pending().evicted, [0]);
}

#[test]
fn without_scrapes_exited_processes_wait_their_full_time() {
    let mut m = Model::new(limits());
    m.event(alloc(GONE, Kind::Malloc, 0x10, 100, 0, 1));
    m.event(task(GONE, TaskEvent::Exec, 0));
    m.housekeep(Instant::now());
    assert_eq!(m.usage().exited, 1);
    m.housekeep(Instant::now() + EXITED_MAX_AGE + Duration::from_secs(1));
    assert_eq!(m.usage().exited, 0);
}

/// A fork written after its child's exec (read a drain late from its parent's CPU's ring)
/// is not a new process: the program the child runs since its exec keeps its blocks.
#[test]
fn a_fork_read_after_the_exec_does_not_end_the_program() {
    let me = std::process::id();
    let mut m = Model::new(limits());
    let at = |ts_ns, event| match task(me, event, 0) {
        Event::Task(t) => Event::Task(Task { ts_ns, ..t }),
        other => other,
    };
    m.event(at(20, TaskEvent::Exec));
    m.event(alloc(me, Kind::Malloc, 0x10, 100, 0, 30));
    m.event(at(10, TaskEvent::Fork));
    assert_eq!(m.usage().exited, 0, "the program is not ended");
    m.event(free(me, Kind::Malloc, 0x10, 0));
    assert_eq!(m.counters.unmatched_frees, 0, "its block's free pairs");
    let live: u64 = stats(&mut m, me).iter().map(|(_, s)| s.live_bytes_req).sum();
    assert_eq!(live, 0);
}

#[test]
fn a_pid_reused_or_renamed_is_followed() {
    let me = std::process::id();
    let mut m = Model::new(limits());
    m.event(alloc(me, Kind::Malloc, 0x10, 100, 0, 1));
    m.event(task(me, TaskEvent::Rename, 0));
    let snap = m.snapshot(Scraper::Metrics);
    assert_eq!(snap.processes[0].comm, "renamed");
    assert_eq!(
        snap.processes[0].cgroup.path,
        Cgroup::from_proc_file(&std::fs::read_to_string("/proc/self/cgroup").unwrap()).path
    );
    m.event(task(me, TaskEvent::Fork, 0)); // a new process with the same pid
    m.event(alloc(me, Kind::Malloc, 0x10, 100, 0, 2));
    let snap = m.snapshot(Scraper::Metrics);
    assert_eq!(snap.processes.len(), 2);
    assert_ne!(snap.processes[0].instance, snap.processes[1].instance);
    // The live process is not ended by the sweep.
    m.housekeep(Instant::now() + Duration::from_secs(31));
    assert_eq!(m.usage().processes, 1);
    assert!(m.live_pids().contains(&me));
}

/// A vfork child allocates in its parent's heap until it execs: the parent frees those
/// blocks (a shell's child), paired; the child's exec leaves the parent's blocks live.
#[test]
fn a_vfork_childs_blocks_are_its_parents_heap() {
    let mut m = Model::new(limits());
    m.event(alloc(GONE, Kind::Malloc, 0x10, 100, 0, 1));
    let mut vfork = task(GONE + 1, TaskEvent::Fork, flags::SHARED_MEMORY);
    if let Event::Task(t) = &mut vfork {
        t.ppid = GONE;
    }
    m.event(vfork);
    m.event(alloc(GONE + 1, Kind::Malloc, 0x20, 100, 0, 2));
    m.event(task(GONE + 1, TaskEvent::Exec, 0));
    m.event(free(GONE, Kind::Free, 0x20, 0));
    assert_eq!((m.counters.inherited_frees, m.counters.unmatched_frees), (0, 0));
    assert_eq!(m.usage().live_blocks, 1, "the parent's block outlives the child's exec");
    m.event(free(GONE, Kind::Free, 0x10, 0));
    assert_eq!((m.usage().live_blocks, m.counters.unmatched_frees), (0, 0));
}

/// A forked child gone before its first event is handled (a shell's `$(…)`) is named as
/// its fork record says, in its parent's cgroup, not `pid N` in none: one label set per
/// command, not per pid. A program exec'd and gone is named by its exec record.
#[test]
fn short_lived_processes_are_named_by_their_task_records() {
    let me = std::process::id();
    let mut m = Model::new(limits());
    m.event(alloc(me, Kind::Malloc, 0x10, 100, 0, 1));
    let mut fork = task(GONE, TaskEvent::Fork, 0);
    if let Event::Task(t) = &mut fork {
        t.ppid = me;
        t.comm = "bash".into();
    }
    m.event(fork);
    m.event(alloc(GONE, Kind::Malloc, 0x20, 100, 0, 2));
    let snap = m.snapshot(Scraper::Metrics);
    let child = snap.processes.iter().find(|p| p.pid == GONE).unwrap();
    let parent = snap.processes.iter().find(|p| p.pid == me).unwrap();
    assert_eq!(child.comm, "bash");
    assert_eq!(child.cgroup.path, parent.cgroup.path);
    let mut exec = task(GONE, TaskEvent::Exec, 0);
    if let Event::Task(t) = &mut exec {
        t.comm = "seq".into();
    }
    m.event(exec);
    m.event(alloc(GONE, Kind::Malloc, 0x30, 100, 0, 3));
    let snap = m.snapshot(Scraper::Metrics);
    let seq = snap.processes.iter().find(|p| p.pid == GONE && p.alive).unwrap();
    assert_eq!((seq.comm.as_str(), &seq.cgroup.path), ("seq", &parent.cgroup.path));
    // A child that execs before its first event keeps its parent's cgroup too.
    let other = GONE + 1;
    let mut fork = task(other, TaskEvent::Fork, 0);
    if let Event::Task(t) = &mut fork {
        t.ppid = me;
    }
    m.event(fork);
    m.event(task(other, TaskEvent::Exec, 0));
    m.event(alloc(other, Kind::Malloc, 0x40, 100, 0, 4));
    let snap = m.snapshot(Scraper::Metrics);
    let p = snap.processes.iter().find(|p| p.pid == other).unwrap();
    assert_eq!((p.comm.as_str(), &p.cgroup.path), ("renamed", &parent.cgroup.path));
}

fn group(comm: &str, domain: Domain) -> Group {
    Group { comm: Arc::from(comm), cgroup: Arc::new(Cgroup::from_path("/a")), pid: None, domain }
}

fn row(instance: u32, stack: u32, site: &str, live: u64, allocs: u64) -> Row {
    Row {
        instance,
        key: SiteKey { stack: StackRef(stack), call_site: 0, kind: Kind::Malloc },
        group: group("app", Domain::User),
        site: Arc::from(site),
        stats: SiteStats {
            allocs,
            bytes_req: allocs * 10,
            bytes_alloc: allocs * 16,
            live_allocs: live / 16,
            live_bytes_req: live,
            live_bytes_alloc: live,
        },
    }
}

#[test]
fn the_top_sites_have_series_and_the_rest_is_other() {
    let mut state = MetricsState::default();
    let rows = vec![row(1, 1, "a", 300, 1), row(1, 2, "b", 200, 2), row(1, 3, "c", 100, 4), row(2, 4, "a", 50, 8)];
    let series = state.update(&rows, 2);
    let (sites, other) = &series.groups[&group("app", Domain::User)];
    assert_eq!(sites.keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(sites["a"].live_bytes, 350, "two processes of one group add up");
    assert_eq!(sites["a"].totals.allocs, 9);
    assert_eq!((other.live_bytes, other.totals.allocs), (100, 4));
}

#[test]
fn counters_never_go_down_as_sites_move_in_and_out_of_the_top() {
    let mut state = MetricsState::default();
    let g = group("app", Domain::User);
    let s1 = state.update(&[row(1, 1, "a", 300, 10), row(1, 2, "b", 100, 20)], 1);
    assert_eq!(s1.groups[&g].0["a"].totals.allocs, 10);
    assert_eq!(s1.groups[&g].1.totals.allocs, 20);
    // b overtakes a: b's series starts from what it did since, a's goes to other.
    let s2 = state.update(&[row(1, 1, "a", 10, 15), row(1, 2, "b", 500, 26)], 1);
    assert_eq!(s2.groups[&g].0.keys().collect::<Vec<_>>(), ["b"]);
    assert_eq!(s2.groups[&g].0["b"].totals.allocs, 6);
    assert_eq!(s2.groups[&g].1.totals.allocs, 25, "other: 20 before, 5 from a since");
    // a comes back: its counter resumes where it was.
    let s3 = state.update(&[row(1, 1, "a", 900, 16), row(1, 2, "b", 0, 26)], 1);
    assert_eq!(s3.groups[&g].0["a"].totals.allocs, 11);
    assert_eq!(s3.groups[&g].1.totals.allocs, 25);
    // The process is gone: its group's series end.
    let t0 = Instant::now();
    let s4 = state.update_at(&[], 1, t0);
    assert!(s4.groups.is_empty());
    // A process of the same group started within the linger goes on from the counters.
    let s5 = state.update_at(&[row(3, 1, "a", 1, 1)], 1, t0 + Duration::from_secs(300));
    assert_eq!(s5.groups[&g].0["a"].totals.allocs, 12, "11 before, 1 since");
    assert_eq!(s5.groups[&g].1.totals.allocs, 25);
    // Gone for longer than the linger: a new process counts from zero.
    state.update_at(&[], 1, t0 + Duration::from_secs(400));
    state.update_at(&[], 1, t0 + Duration::from_secs(400) + metrics::GROUP_LINGER);
    let s6 = state.update_at(&[row(4, 1, "a", 1, 1)], 1, t0 + Duration::from_secs(1100));
    assert_eq!(s6.groups[&g].0["a"].totals.allocs, 1, "a new process counts from zero");
}

#[test]
fn lingering_groups_are_bounded() {
    let mut state = MetricsState::default();
    let t0 = Instant::now();
    let many: Vec<Row> = (0..metrics::MAX_LINGERING as u32 + 10)
        .map(|i| {
            let mut r = row(i, 1, "a", 1, 1);
            r.group = group(&format!("job{i}"), Domain::User);
            r
        })
        .collect();
    state.update_at(&many, 1, t0);
    state.update_at(&[], 1, t0 + Duration::from_secs(1));
    // The first 10 are dropped (arbitrarily among equals); the rest go on.
    let again = state.update_at(&many, 1, t0 + Duration::from_secs(2));
    let resumed = again.groups.values().filter(|(sites, _)| sites["a"].totals.allocs == 2).count();
    assert_eq!(resumed, metrics::MAX_LINGERING);
}

/// When a process exits its live bytes are all 0: its series stay those shown before (they
/// did change hands by name, hiding the counts of the sites that left).
#[test]
fn the_sites_shown_stay_shown_when_their_process_exits() {
    let mut state = MetricsState::default();
    let g = group("app", Domain::User);
    let s1 = state.update(&[row(1, 1, "z", 300, 1), row(1, 2, "y", 100, 1), row(1, 3, "a", 0, 50)], 2);
    assert_eq!(s1.groups[&g].0.keys().collect::<Vec<_>>(), ["y", "z"]);
    let s2 = state.update(&[row(1, 1, "z", 0, 1), row(1, 2, "y", 0, 1), row(1, 3, "a", 0, 50)], 2);
    assert_eq!(s2.groups[&g].0.keys().collect::<Vec<_>>(), ["y", "z"]);
    assert_eq!(s2.groups[&g].1.totals.allocs, 50);
}

/// `--max-series`: the groups with the most live bytes keep their series while they fit;
/// the rest are summed into one `comm="[other]"` series, whose counters only go up, and a
/// group that comes back goes on from its own.
#[test]
fn groups_past_the_series_cap_are_summed_into_one_series() {
    let mut state = MetricsState::default();
    state.max_series = 10;
    let job = |i: u32, live: u64, allocs: u64| {
        // Three sites each: with the top 2, a group costs 3 series (2 and its [other]).
        (0..3).map(move |s| {
            let mut r = row(i, 10 * i + s, &format!("site{s}"), live, allocs);
            r.group = group(&format!("job{i}"), Domain::User);
            r
        })
    };
    let scrape1: Vec<Row> = (1..=5).flat_map(|i| job(i, 100 * u64::from(i), 1)).collect();
    let s1 = state.update(&scrape1, 2);
    // 1 series for the overflow, 3 per group: jobs 5, 4 and 3 fit in 10.
    let shown: Vec<&str> = s1.groups.keys().map(|g| &*g.comm).collect();
    assert_eq!(shown, ["[other]", "job3", "job4", "job5"]);
    assert_eq!(s1.folded_groups, 2);
    let overflow = &s1.groups[&metrics::overflow_group(Domain::User)];
    assert!(overflow.0.is_empty(), "the overflow has its [other] series only");
    assert_eq!((overflow.1.live_bytes, overflow.1.totals.allocs), (3 * 100 + 3 * 200, 6));
    let series: usize = s1.groups.values().map(|(sites, _)| sites.len() + 1).sum();
    assert!(series <= 10, "{series}");

    // Job 1 grows past the others: it gets series of its own, its counters from its own
    // (1 each before, folded meanwhile), and job 3 is folded; the overflow's only go up.
    let scrape2: Vec<Row> = job(1, 10_000, 2).chain((2..=5).flat_map(|i| job(i, 100 * u64::from(i), 2))).collect();
    let s2 = state.update(&scrape2, 2);
    let shown: Vec<&str> = s2.groups.keys().map(|g| &*g.comm).collect();
    assert_eq!(shown, ["[other]", "job1", "job4", "job5"]);
    let job1 = &s2.groups[&group("job1", Domain::User)];
    assert_eq!(job1.0.values().map(|f| f.totals.allocs).sum::<u64>() + job1.1.totals.allocs, 3, "1 per site since");
    let overflow = &s2.groups[&metrics::overflow_group(Domain::User)];
    assert_eq!(overflow.1.totals.allocs, 6 + 6, "6 before; jobs 2 and 3 did 3 each since");
    let text = metrics::encode(&s2, &own(), false);
    assert!(text.contains("memtrace_groups_folded 2\n"), "{text}");
    assert!(
        text.contains("memtrace_live_bytes{site=\"[other]\",domain=\"user\",comm=\"[other]\",cgroup=\"\"} "),
        "{text}"
    );

    // No cap: every group.
    let mut uncapped = MetricsState::default();
    assert_eq!(uncapped.update(&scrape1, 2).groups.len(), 5);

    // A group with more sites than the cap holds keeps those that fit (here 10: the
    // overflow's series, its [other], 8 sites), not none.
    let mut state = MetricsState::default();
    state.max_series = 10;
    let big = |i: u32, live: u64| {
        (0..30).map(move |s| {
            let mut r = row(i, 100 * i + s, &format!("site{s:02}"), live + u64::from(s), 1);
            r.group = group(&format!("big{i}"), Domain::User);
            r
        })
    };
    let rows: Vec<Row> = big(1, 1000).chain(big(2, 10)).collect();
    let s = state.update(&rows, 20);
    let shown: Vec<&str> = s.groups.keys().map(|g| &*g.comm).collect();
    assert_eq!(shown, ["[other]", "big1"]);
    let (sites, _) = &s.groups[&group("big1", Domain::User)];
    assert_eq!(sites.len(), 8);
    assert!(sites.contains_key("site29"), "the sites with the most live bytes: {sites:?}");
    assert_eq!(s.groups.values().map(|(sites, _)| sites.len() + 1).sum::<usize>(), 10);
}

fn own() -> metrics::SelfFigures {
    let mut ring_fill = super::selfstats::FillHistogram::default();
    for fill in [0.0, 0.05, 0.3, 0.95, 1.0, 1.5] {
        ring_fill.observe(fill);
    }
    metrics::SelfFigures {
        scrapes: vec![("metrics", 3)],
        responses: vec![(200, 2), (404, 1)],
        ring_fill,
        ..Default::default()
    }
}

#[test]
fn the_exposition_is_openmetrics_or_classic_text() {
    let mut state = MetricsState::default();
    let mut leak = row(1, 1, "leak (a.c:3) \"quoted\"", 300, 1);
    leak.group.cgroup = Arc::new(Cgroup::from_path(
        "/kubepods.slice/kubepods-pod0a1b2c3d_0000_1111_2222_333344445555.slice/cri-containerd-4f3c9d2a1b0e8f7a6d5c4b3a2918f7e6d5c4b3a29180f7e6d5c4b3a291807f6e.scope",
    ));
    // A backslash and a newline in a label value are escaped.
    let odd = row(1, 2, "odd\\path\nnext", 100, 1);
    let series = state.update(&[leak, odd], 20);
    let om = metrics::encode(&series, &own(), true);
    assert!(om.contains("site=\"odd\\\\path\\nnext\""), "{om}");
    assert!(om.ends_with("# EOF\n"));
    assert!(om.contains("# TYPE memtrace_allocations counter\n"));
    assert!(
        om.contains("memtrace_allocations_total{site=\"leak (a.c:3) \\\"quoted\\\"\",domain=\"user\",comm=\"app\"")
    );
    assert!(om.contains("pod_uid=\"0a1b2c3d-0000-1111-2222-333344445555\",container_id=\"4f3c9d2a"));
    let text = metrics::encode(&series, &own(), false);
    assert!(!text.contains("# EOF") && !text.contains("# UNIT"));
    assert!(text.contains("# TYPE memtrace_allocations_total counter\n"));
    assert!(text.contains("# HELP memtrace_allocations_total Allocations"));
    assert!(text.contains("# TYPE memtrace_live_bytes gauge\n"));
    assert!(text.contains("memtrace_live_bytes{site=\"[other]\""));
    assert!(text.contains("\nprocess_cpu_seconds_total 0"), "no empty braces: {text}");
    // How full the rings were at each drain: a histogram, cumulative (1.5 is clamped to a
    // full ring), so two scrapers read the same counts.
    assert!(text.contains("# TYPE memtrace_ring_fill_ratio histogram\n"), "{text}");
    for sample in [
        "memtrace_ring_fill_ratio_bucket{le=\"0.1\"} 2\n",
        "memtrace_ring_fill_ratio_bucket{le=\"0.5\"} 3\n",
        "memtrace_ring_fill_ratio_bucket{le=\"0.9\"} 3\n",
        "memtrace_ring_fill_ratio_bucket{le=\"1.0\"} 6\n",
        "memtrace_ring_fill_ratio_bucket{le=\"+Inf\"} 6\n",
        "memtrace_ring_fill_ratio_count 6\n",
    ] {
        assert!(text.contains(sample), "{sample}: {text}");
    }
    assert!(om.contains("# UNIT memtrace_ring_fill_ratio ratio\n"), "{om}");
    // Every sample belongs to the family declared before it.
    let mut declared = String::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            declared = rest.split(' ').next().unwrap().to_string();
        } else if !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s));
            assert!(name == declared || family == Some(declared.as_str()), "{line} after {declared}");
        }
    }
    // With promtool at hand (cargo xtask setup installs it), the real check.
    if let Ok(mut child) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn accept_headers_choose_the_format() {
    assert!(metrics::wants_openmetrics(
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    ));
    assert!(!metrics::wants_openmetrics("*/*"));
    assert!(!metrics::wants_openmetrics("text/plain"));
    assert!(!metrics::wants_openmetrics("application/openmetrics-text; q=0"));
    assert!(!metrics::wants_openmetrics("application/openmetrics-text;version=1.0.0;q=0.0, text/plain;q=0.5"));
    assert_eq!(
        metrics::openmetrics_to_text("# HELP a_b x\n# TYPE a_b counter\n# UNIT a_b b\na_b_total 1\n# EOF\n"),
        "# HELP a_b_total x\n# TYPE a_b_total counter\na_b_total 1\n"
    );
}

#[test]
fn profile_queries_are_parsed_or_refused_in_one_line() {
    assert_eq!(parse_query("", 300).unwrap(), ProfileQuery::default());
    let q = parse_query("seconds=2&pid=12,13&pid=14&domain=user&gc=1&debug=0", 300).unwrap();
    assert_eq!(q, ProfileQuery { seconds: Some(2), pids: vec![12, 13, 14], domain: Some(Domain::User) });
    assert_eq!(parse_query("domain=kernel", 300).unwrap().domain, Some(Domain::Kernel));
    assert_eq!(parse_query("domain=%6Bernel", 300).unwrap().domain, Some(Domain::Kernel), "percent-encoded");
    for (query, needle) in [
        ("seconds=abc", "\"seconds\""),
        ("seconds=0", "positive integer"),
        ("seconds=-3", "positive integer"),
        ("seconds=301", "at most 300"),
        ("seconds=1&seconds=2", "twice"),
        ("pid=x", "\"pid\""),
        ("pid=0", "process id"),
        ("domain=gpu", "user or kernel"),
        ("debug=1", "not supported"),
        ("frobnicate=1", "unknown parameter \"frobnicate\""),
        ("domain=%zz", "percent-encoding"),
    ] {
        let e = parse_query(query, 300).unwrap_err();
        assert!(e.0.contains(needle), "{query}: {e}");
        assert!(!e.0.contains('\n'), "{query}: one line");
    }
}

/// A model with one process, one named user stack and one kernel site, and its names.
fn profiled() -> (Model, Names) {
    let mut m = Model::new(limits());
    m.event(alloc(GONE, Kind::Malloc, 0x10, 100, 0xaaa, 1));
    m.event(alloc(GONE, Kind::Malloc, 0x20, 100, 0xaaa, 2));
    m.event(free(GONE, Kind::Free, 0x10, 0));
    m.event(alloc(GONE, Kind::Kmalloc, 0xffff_0010, 64, 0, 3));
    let mut names = Names::default();
    names.integrate(Pending {
        stacks: vec![FileStack {
            id: 0,
            pid: GONE,
            kernel: vec![],
            user: vec![FileFrame::Module { module: 0, offset: 0x10 }, FileFrame::Module { module: 0, offset: 0x20 }],
            truncated: false,
        }],
        modules: vec![Module { id: 0, build_id: vec![], path: "/usr/bin/app".into() }],
        evicted: vec![],
        call_sites: vec![],
    });
    let sym = |name: &str, line| Symbol { name: name.into(), file: Some("/src/app.c".into()), line, inlined: false };
    names.insert(vec![
        (SymbolKey::User(FileFrame::Module { module: 0, offset: 0x10 }), vec![sym("leak", 3)]),
        (SymbolKey::User(FileFrame::Module { module: 0, offset: 0x20 }), vec![sym("main", 9)]),
        (SymbolKey::Kernel(0xffff_ffff_8100_0000), vec![Symbol { name: "alloc_thing".into(), ..Default::default() }]),
    ]);
    (m, names)
}

#[test]
fn profiles_carry_gos_sample_types_and_defaults() {
    let (mut m, mut names) = profiled();
    let snap = m.snapshot(Scraper::Heap);
    for kind in [ProfileKind::Heap, ProfileKind::Allocs] {
        let bytes = profile::build(&snap, None, &mut names, kind, &ProfileQuery::default()).unwrap();
        let p = pprof_messages::decode_gzipped(&bytes);
        let types: Vec<(String, String)> = p.sample_types();
        assert_eq!(
            types,
            [
                ("alloc_objects", "count"),
                ("alloc_space", "bytes"),
                ("inuse_objects", "count"),
                ("inuse_space", "bytes")
            ]
            .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        let default = (p.default_sample_type != 0).then(|| p.string(p.default_sample_type).to_string());
        assert_eq!(default.as_deref(), if kind == ProfileKind::Heap { None } else { Some("alloc_space") });
        let period_type = p.period_type.clone().unwrap();
        assert_eq!((p.string(period_type.r#type), p.string(period_type.unit), p.period), ("space", "bytes", 1));
        assert_eq!(p.sample.len(), 2);
        let user = p.sample.iter().find(|s| p.label(s, "domain").as_deref() == Some("user")).unwrap();
        assert_eq!(p.functions(user), ["leak", "main"]);
        assert_eq!(user.value, [2, 216, 1, 108]);
        assert_eq!(p.num_label(user, "pid"), Some(i64::from(GONE)));
        let kernel = p.sample.iter().find(|s| p.label(s, "domain").as_deref() == Some("kernel")).unwrap();
        assert_eq!(p.functions(kernel), ["alloc_thing"]);
    }
    // Filters.
    let q = ProfileQuery { domain: Some(Domain::Kernel), ..Default::default() };
    let p = pprof_messages::decode_gzipped(&profile::build(&snap, None, &mut names, ProfileKind::Heap, &q).unwrap());
    assert_eq!(p.sample.len(), 1);
    let q = ProfileQuery { pids: vec![7], ..Default::default() };
    let e = profile::build(&snap, None, &mut names, ProfileKind::Heap, &q).unwrap_err();
    assert!(e.0.contains("pid 7 is not traced"), "{e}");
}

#[test]
fn delta_profiles_hold_only_the_window_and_scale_with_the_period() {
    let (mut m, mut names) = profiled();
    let base = m.snapshot(Scraper::Allocs);
    m.event(alloc(GONE, Kind::Malloc, 0x30, 100, 0xaaa, 4));
    m.event(free(GONE, Kind::Free, 0x20, 0));
    let now = m.snapshot(Scraper::Allocs);
    let bytes = profile::build(&now, Some(&base), &mut names, ProfileKind::Allocs, &ProfileQuery::default()).unwrap();
    let p = pprof_messages::decode_gzipped(&bytes);
    assert_eq!(p.sample.len(), 1, "the kernel site did nothing in the window");
    assert_eq!(p.sample[0].value, [1, 108, 0, 0]);
    assert!(p.duration_nanos >= 0);
    let mut sampled = Model::new(Limits { sample_bytes: Some(512 << 10), ..limits() });
    sampled.event(alloc(GONE, Kind::Malloc, 0x10, 1 << 20, 0, 1));
    let snap = sampled.snapshot(Scraper::Heap);
    let p = pprof_messages::decode_gzipped(
        &profile::build(&snap, None, &mut Names::default(), ProfileKind::Heap, &ProfileQuery::default()).unwrap(),
    );
    assert_eq!(p.period, 512 << 10);
    assert_eq!(p.functions(&p.sample[0]), ["[no stack: malloc]"]);
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn config(args: &[&str]) -> anyhow::Result<Config> {
    let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))?;
    Config::from_args(cli.serve)
}

#[test]
fn the_command_line_defaults_to_sampling_on_the_loopback() {
    let c = config(&["-a"]).unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:6060");
    assert_eq!(c.trace.sample_bytes, Some(512 << 10));
    assert!(matches!(c.trace.target, Target::All));
    assert_eq!((c.http.top_sites, c.http.auth_token.as_ref()), (20, None));
    let c = config(&["--pid", "1", "--pid", "2", "--pid", "1", "--sample-bytes", "0", "--listen", "9000"]).unwrap();
    assert_eq!((c.pids.as_slice(), c.trace.sample_bytes), (&[1, 2][..], None));
    assert_eq!(c.listen.to_string(), "127.0.0.1:9000");
    assert!(matches!(config(&["--", "sleep", "1"]).unwrap().trace.target, Target::Command(_)));
    let e = config(&[]).unwrap_err().to_string();
    assert!(e.contains("say what to trace"), "{e}");
    assert!(config(&["-a", "--pid", "1"]).is_err());
    assert!(config(&["-a", "--top-sites", "0"]).unwrap_err().to_string().contains("--top-sites"));
    assert!(config(&["-a", "--ring-size", "5000"]).unwrap_err().to_string().contains("power of two"));
}

#[test]
fn listen_addresses() {
    assert_eq!(parse_listen(":7000").unwrap().to_string(), "127.0.0.1:7000");
    assert_eq!(parse_listen("0.0.0.0:7000").unwrap().to_string(), "0.0.0.0:7000");
    assert_eq!(parse_listen("[::1]:7000").unwrap().to_string(), "[::1]:7000");
    assert!(parse_listen("localhost:7000").unwrap().ip().is_loopback());
    for bad in ["", "host", "1.2.3.4:x", "1.2.3.4:70000"] {
        assert!(parse_listen(bad).is_err(), "{bad}");
    }
}

#[test]
fn tokens_are_one_line_and_may_come_through_a_symlink() {
    let tmp = tempfile::Builder::new().prefix("memtrace-token-").tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    std::fs::write(dir.join("token"), "s3cret\n").unwrap();
    std::os::unix::fs::symlink(dir.join("token"), dir.join("link")).unwrap();
    assert_eq!(read_token(&dir.join("link")).unwrap(), "s3cret");
    std::fs::write(dir.join("empty"), "\n").unwrap();
    assert!(read_token(&dir.join("empty")).unwrap_err().to_string().contains("empty"));
    std::fs::write(dir.join("two"), "a b\n").unwrap();
    assert!(read_token(&dir.join("two")).is_err());
    assert!(read_token(&dir).unwrap_err().to_string().contains("not a regular file"));
    assert!(read_token(&dir.join("missing")).is_err());
}

fn http_config(token: Option<&str>, header_timeout: Duration) -> HttpConfig {
    HttpConfig {
        auth_token: token.map(String::from),
        max_connections: 2,
        max_profile_seconds: 5,
        header_timeout,
        request_timeout: Duration::from_secs(5),
        top_sites: 20,
        pid_label: false,
        max_series: 2000,
    }
}

fn serve(token: Option<&str>, header_timeout: Duration) -> (Server, std::net::SocketAddr, Arc<Shared>) {
    let listener = super::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr().unwrap();
    let shared = Arc::new(Shared::new(limits()));
    {
        let mut m = shared.model.lock().unwrap();
        m.event(alloc(GONE, Kind::Malloc, 0x10, 100, 0, 1));
    }
    let server = Server::start(listener, Arc::clone(&shared), http_config(token, header_timeout)).unwrap();
    (server, addr, shared)
}

/// One request on a fresh connection: (status, headers, body).
fn get(addr: std::net::SocketAddr, request: &str) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head, raw[split + 4..].to_vec())
}

fn request(path: &str, extra: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{extra}\r\n")
}

#[test]
fn the_server_answers_bad_requests_in_one_line() {
    let (server, addr, shared) = serve(None, Duration::from_secs(5));
    let (code, head, body) = get(addr, &request("/metrics", ""));
    assert_eq!(code, 200);
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert!(String::from_utf8(body).unwrap().contains("memtrace_live_bytes{site=\"[no stack: malloc]\""));
    let (_, head, body) = get(addr, &request("/metrics", "Accept: application/openmetrics-text;version=1.0.0\r\n"));
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(body.ends_with(b"# EOF\n"));
    let (code, head, body) = get(addr, &request("/debug/pprof/heap", ""));
    assert_eq!(code, 200);
    assert!(head.contains("application/octet-stream") && head.contains("filename=\"heap\""), "{head}");
    assert_eq!(pprof_messages::decode_gzipped(&body).sample.len(), 1);
    for (req, want, needle) in [
        (request("/debug/pprof/heap?seconds=abc", ""), 400, "\"seconds\""),
        (request("/debug/pprof/allocs?pid=12", ""), 400, "pid 12 is not traced"),
        (request("/metrics?x=%zz", ""), 400, "bad percent-encoding"),
        (request("/nope", ""), 404, "no such endpoint \"/nope\""),
        (request("/debug/pprof/goroutine", ""), 404, "unknown profile \"goroutine\""),
        (
            "POST /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 0\r\n\r\n".into(),
            405,
            "GET or HEAD",
        ),
    ] {
        let (code, _, body) = get(addr, &req);
        let body = String::from_utf8(body).unwrap();
        assert_eq!(code, want, "{req}: {body}");
        assert!(body.contains(needle), "{req}: {body}");
        assert_eq!(body.lines().count(), 1, "{body}");
    }
    // A scrape config's `params:` (shared with other exporters) do not fail the scrape.
    let (code, _, body) = get(addr, &request("/metrics?module=memtrace&collect%5B%5D=x", ""));
    assert_eq!(code, 200);
    assert!(String::from_utf8(body).unwrap().contains("memtrace_live_bytes{"));
    let (code, _, body) = get(addr, &request("/", ""));
    assert_eq!(code, 200);
    assert!(String::from_utf8(body).unwrap().contains("/debug/pprof/heap"));
    // A delta profile waits its seconds.
    let started = Instant::now();
    let (code, head, _) = get(addr, &request("/debug/pprof/allocs?seconds=1", ""));
    assert_eq!(code, 200);
    assert!(started.elapsed() >= Duration::from_secs(1) && head.contains("allocs-delta"));
    server.shutdown(Duration::from_secs(1));
    let counted = shared.responses.lock().unwrap().clone();
    assert_eq!(counted.get(&400), Some(&3));
}

/// HEAD gets the headers a GET would, checked as a GET is, at once: no scrape is taken
/// (it would count as the scraper having seen the processes that exited), no delta waited.
#[test]
fn head_requests_get_the_headers_without_a_scrape() {
    let (server, addr, shared) = serve(None, Duration::from_secs(5));
    let head = |path: &str| format!("HEAD {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    let (code, headers, body) = get(addr, &head("/metrics"));
    assert_eq!(code, 200);
    assert!(headers.contains("text/plain; version=0.0.4"), "{headers}");
    assert!(body.is_empty());
    let started = Instant::now();
    let (code, headers, body) = get(addr, &head("/debug/pprof/allocs?seconds=5"));
    assert_eq!(code, 200);
    assert!(headers.contains("filename=\"allocs-delta\"") && body.is_empty(), "{headers}");
    assert!(started.elapsed() < Duration::from_secs(2), "no wait for a HEAD");
    assert_eq!(get(addr, &head("/debug/pprof/heap?seconds=abc")).0, 400);
    assert_eq!(get(addr, &head("/metrics?x=%zz")).0, 400);
    assert_eq!(get(addr, &head("/metrics?module=memtrace")).0, 200);
    assert_eq!(get(addr, &head("/metrics?x=%ff")).0, 200, "escaped bytes need not be UTF-8");
    assert_eq!(get(addr, &head("/nope")).0, 404);
    let scrapes: Vec<u64> = shared.scrapes.iter().map(|n| n.load(std::sync::atomic::Ordering::Relaxed)).collect();
    assert_eq!(scrapes, [0, 0, 0]);
    // A GET is a scrape.
    assert_eq!(get(addr, &request("/metrics", "")).0, 200);
    assert_eq!(shared.scrapes[0].load(std::sync::atomic::Ordering::Relaxed), 1);
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn a_token_is_required_when_configured() {
    let (server, addr, _) = serve(Some("s3cret"), Duration::from_secs(5));
    let (code, head, _) = get(addr, &request("/metrics", ""));
    assert_eq!(code, 401);
    assert!(head.to_ascii_lowercase().contains("www-authenticate: bearer"), "{head}");
    assert_eq!(get(addr, &request("/metrics", "Authorization: Bearer wrong\r\n")).0, 401);
    assert_eq!(get(addr, &request("/metrics", "Authorization: Bearer s3cret\r\n")).0, 200);
    assert_eq!(get(addr, &request("/debug/pprof/heap", "Authorization: bearer s3cret\r\n")).0, 200);
    assert_eq!(get(addr, &request("/healthz", "")).0, 200, "health checks need no token");
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn slow_clients_time_out_and_extra_ones_are_turned_away() {
    let (server, addr, _) = serve(None, Duration::from_secs(2));
    // Clients that never finish their request hold a connection, not a slot: a scrape and
    // the health check are answered at once beside them.
    let slow = |n: usize| -> Vec<TcpStream> {
        (0..n)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
                s
            })
            .collect()
    };
    let idle = slow(2);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(get(addr, &request("/metrics", "")).0, 200, "the two slots are free");
    // Two delta profiles being answered take both slots: a third profile waits a second for
    // one, then hears 503 (asked until the deltas have their slots, however slow the
    // machine); scrapes of /metrics have slots of their own, and the health check takes
    // none.
    let deltas: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(move || get(addr, &request("/debug/pprof/allocs?seconds=4", "")).0))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    let busy = loop {
        let started = Instant::now();
        let (code, _, _) = get(addr, &request("/debug/pprof/heap", ""));
        if code == 503 {
            break Some(started.elapsed());
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(busy.expect("503 while both slots are taken") >= Duration::from_millis(900));
    let scraped = Instant::now();
    assert_eq!(get(addr, &request("/metrics", "")).0, 200);
    assert!(scraped.elapsed() < Duration::from_millis(900), "a scrape waited for a slot");
    assert_eq!(get(addr, &request("/healthz", "")).0, 200);
    for d in deltas {
        assert_eq!(d.join().unwrap(), 200);
    }
    // Connections beyond 16 per slot are turned away at once (the first slow ones are gone
    // by now: their head deadline passed during the deltas).
    let more = slow(2 * 16);
    std::thread::sleep(Duration::from_millis(100));
    // (The health check takes no slot: its 503 is the connections' cap.)
    assert_eq!(get(addr, &request("/healthz", "")).0, 503);
    // The slow ones are cut off at the head deadline (2 s here), with an end of stream;
    // then there is room.
    for mut s in idle.into_iter().chain(more) {
        s.set_read_timeout(Some(Duration::from_secs(8))).unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).expect("closed by the server, not timed out here");
    }
    assert_eq!(get(addr, &request("/metrics", "")).0, 200);
    let started = Instant::now();
    server.shutdown(Duration::from_secs(1));
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(TcpStream::connect(addr).is_err(), "the port is released");
}

/// A delta profile for a pid that is no process is refused before its wait, not after.
#[test]
fn a_delta_profile_checks_its_pids_first() {
    let (server, addr, _) = serve(None, Duration::from_secs(5));
    let started = Instant::now();
    let (code, _, body) = get(addr, &request("/debug/pprof/heap?seconds=5&pid=4194399", ""));
    assert_eq!(code, 400);
    assert!(String::from_utf8(body).unwrap().contains("pid 4194399 is not traced"));
    assert!(started.elapsed() < Duration::from_secs(2));
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn deploy_systemd_unit_runs_serve_safely() {
    let unit = include_str!("../../../deploy/memtrace.service");
    let mut section = String::new();
    let mut keys: Vec<(String, String, String)> = Vec::new();
    for line in unit.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_string();
            continue;
        }
        let (k, v) = line.split_once('=').unwrap_or_else(|| panic!("not key=value: {line}"));
        keys.push((section.clone(), k.to_string(), v.to_string()));
    }
    let get = |s: &str, k: &str| keys.iter().find(|(a, b, _)| a == s && b == k).map(|(_, _, v)| v.as_str());
    for s in ["Unit", "Service", "Install"] {
        assert!(keys.iter().any(|(a, _, _)| a == s), "section [{s}]");
    }
    assert_eq!(get("Install", "WantedBy"), Some("multi-user.target"));
    assert_eq!(get("Service", "KillSignal"), Some("SIGTERM"));
    assert_eq!(get("Service", "NoNewPrivileges"), Some("yes"));
    assert_eq!(get("Service", "ProtectSystem"), Some("strict"), "memtrace writes no file");
    let caps = get("Service", "CapabilityBoundingSet").unwrap();
    for cap in ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN"] {
        assert!(caps.contains(cap), "{cap}");
    }
    let exec = get("Service", "ExecStart").unwrap();
    let argv: Vec<&str> = exec.split_whitespace().collect();
    assert!(argv[0].ends_with("/memtrace") && argv[1] == "serve", "{exec}");
    let c = config(&argv[2..]).unwrap();
    assert!(c.listen.ip().is_loopback(), "the unit listens on the loopback");
    assert!(matches!(c.trace.target, Target::All));
}

#[test]
fn deploy_daemonset_is_privileged_with_the_host_pids_and_scrape_annotations() {
    use yaml_rust2::{Yaml, YamlLoader};
    let docs = YamlLoader::load_from_str(include_str!("../../../deploy/daemonset.yaml")).unwrap();
    assert_eq!(docs.len(), 1);
    let ds = &docs[0];
    assert_eq!(ds["apiVersion"].as_str(), Some("apps/v1"));
    assert_eq!(ds["kind"].as_str(), Some("DaemonSet"));
    let labels = &ds["spec"]["selector"]["matchLabels"];
    assert_eq!(&ds["spec"]["template"]["metadata"]["labels"], labels, "the selector picks the pods");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"].as_bool(), Some(true));
    let annotations = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"].as_str(), Some("true"), "a string, as Kubernetes requires");
    assert_eq!(annotations["prometheus.io/path"].as_str(), Some("/metrics"));
    assert_eq!(annotations["profiles.grafana.com/memory.scrape"].as_str(), Some("true"));
    let port: u16 = annotations["prometheus.io/port"].as_str().unwrap().parse().unwrap();
    assert_eq!(annotations["profiles.grafana.com/memory.port"].as_str(), Some(port.to_string().as_str()));
    let containers = pod["containers"].as_vec().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(true));
    assert_eq!(c["ports"][0]["containerPort"].as_i64(), Some(i64::from(port)));
    let args: Vec<&str> = c["args"].as_vec().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(args[0], "serve");
    let cfg = config(&args[1..]).unwrap();
    assert_eq!(cfg.listen.port(), port, "memtrace listens where the annotations say");
    assert!(!cfg.listen.ip().is_loopback(), "scrapers reach the pod's address");
    assert!(matches!(cfg.trace.target, Target::All));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"].as_str(), Some("/healthz"));
    assert!(matches!(c["resources"]["limits"]["memory"], Yaml::String(_)));
    // The tracing file systems come from the host.
    let mounts: Vec<&str> =
        c["volumeMounts"].as_vec().unwrap().iter().map(|m| m["mountPath"].as_str().unwrap()).collect();
    assert!(mounts.contains(&"/sys/kernel/tracing"));
}
