//! Pairing and aggregation on hand-written event sequences.
use memtrace_common::{Kind, TaskEvent, flags};

use super::*;
use crate::event::{Alloc, Event, Free, Task};

#[allow(clippy::too_many_arguments, reason = "a compact way to write test events")]
fn alloc(ts: u64, pid: u32, tid: u32, kind: Kind, ptr: u64, req: u64, alloc: u64, stack: u64) -> Event {
    Event::Alloc(Alloc {
        ts_ns: ts,
        pid,
        tid,
        cpu: 0,
        kind,
        flags: 0,
        ptr,
        bytes_req: req,
        bytes_alloc: alloc,
        stack,
        call_site: 0,
        gfp_flags: 0,
        node: -1,
        order: 0,
        allocator: 0,
        cache: 0,
    })
}

fn free(ts: u64, pid: u32, tid: u32, kind: Kind, ptr: u64) -> Event {
    Event::Free(Free { ts_ns: ts, pid, tid, cpu: 0, kind, flags: 0, ptr, arg: 0 })
}

fn exit(ts: u64, pid: u32) -> Event {
    Event::Task(Task {
        ts_ns: ts,
        event: TaskEvent::Exit,
        flags: flags::GROUP_DEAD,
        pid,
        tid: pid,
        ppid: 0,
        comm: String::new(),
        filename: String::new(),
    })
}

/// Groups by stack id.
fn by_stack() -> Analyzer<impl FnMut(&Origin) -> u32 + use<>> {
    Analyzer::new(|o: &Origin| o.stack as u32)
}

fn run(events: &[Event]) -> Analyzer<impl FnMut(&Origin) -> u32 + use<>> {
    let mut a = by_stack();
    for e in events {
        a.push(e);
    }
    a.finish();
    a
}

#[test]
fn frees_count_against_the_allocating_site() {
    let a = run(&[
        alloc(1, 10, 10, Kind::Malloc, 0x1000, 24, 40, 1),
        alloc(2, 10, 11, Kind::Malloc, 0x2000, 100, 104, 2),
        free(3, 10, 11, Kind::Free, 0x1000), // another thread frees site 1's block
    ]);
    let s1 = &a.groups[1];
    assert_eq!((s1.allocs, s1.frees, s1.live_allocs, s1.live_bytes_req), (1, 1, 0, 0));
    assert_eq!(s1.lifetimes.count(), 1);
    let s2 = &a.groups[2];
    assert_eq!((s2.allocs, s2.frees, s2.live_allocs, s2.live_bytes_req), (1, 0, 1, 100));
    let user = &a.totals[&Domain::User];
    assert_eq!((user.stats.allocs, user.stats.bytes_req, user.stats.bytes_alloc), (2, 124, 144));
    assert_eq!(user.stats.frag_pct(), 100.0 - 100.0 * 124.0 / 144.0);
}

#[test]
fn a_realloc_is_a_free_and_an_allocation() {
    let mut old_free = free(5, 1, 1, Kind::Free, 0x1000);
    if let Event::Free(f) = &mut old_free {
        f.flags = flags::BY_REALLOC;
    }
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 10, 24, 1),
        old_free,
        alloc(6, 1, 1, Kind::Realloc, 0x3000, 500, 504, 2),
    ]);
    assert_eq!((a.groups[1].frees, a.groups[1].live_allocs), (1, 0));
    assert_eq!((a.groups[2].allocs, a.groups[2].live_bytes_req), (1, 500));
}

#[test]
fn frees_of_unknown_blocks_are_counted_not_paired() {
    let a = run(&[free(1, 1, 1, Kind::Free, 0xdead), free(2, 0, 0, Kind::Kfree, 0xbeef)]);
    assert_eq!(a.totals[&Domain::User].unmatched_frees, 1);
    assert_eq!(a.totals[&Domain::Kernel].unmatched_frees, 1);
    assert_eq!(a.totals[&Domain::User].stats.frees, 0);
}

#[test]
fn a_reused_pid_is_a_new_address_space() {
    let a = run(&[
        alloc(1, 7, 7, Kind::Malloc, 0x1000, 8, 24, 1),
        exit(2, 7),
        // Same pid, same address: another process. Its free must not free the old block.
        free(3, 7, 7, Kind::Free, 0x1000),
        alloc(4, 7, 7, Kind::Malloc, 0x1000, 16, 24, 2),
    ]);
    assert_eq!((a.groups[1].live_allocs, a.groups[1].leaked_at_exit, a.groups[1].frees), (1, 1, 0));
    assert_eq!(a.totals[&Domain::User].unmatched_frees, 1);
    assert_eq!(a.totals[&Domain::User].missed_frees, 0);
    assert_eq!(a.live_blocks().count(), 2);
}

#[test]
fn kernel_blocks_pair_across_processes_and_cpus() {
    let mut k = alloc(1, 5, 5, Kind::KmemCacheAlloc, 0xffff_1000, 64, 64, 1);
    if let Event::Alloc(a) = &mut k {
        a.cpu = 0;
    }
    let mut f = free(2, 0, 0, Kind::Kfree, 0xffff_1000);
    if let Event::Free(f) = &mut f {
        f.cpu = 1;
    }
    let a = run(&[k, f]);
    assert_eq!((a.groups[1].frees, a.groups[1].freed_on_other_cpu), (1, 1));
}

#[test]
fn munmap_frees_every_region_in_its_range_and_ignores_the_rest() {
    let mut unmap = free(4, 1, 1, Kind::Munmap, 0x10000);
    if let Event::Free(f) = &mut unmap {
        f.arg = 3; // three pages: covers the first two regions
    }
    let a = run(&[
        alloc(1, 1, 1, Kind::Mmap, 0x10000, 4096, 4096, 1),
        alloc(2, 1, 1, Kind::Mmap, 0x11000, 4096, 4096, 1),
        alloc(3, 1, 1, Kind::Mmap, 0x20000, 8192, 8192, 2),
        unmap,
        free(5, 1, 1, Kind::Munmap, 0x90000), // the allocator's own chunk: not ours
    ]);
    assert_eq!((a.groups[1].frees, a.groups[1].live_allocs), (2, 0));
    assert_eq!(a.groups[2].live_allocs, 1);
    assert_eq!(a.totals[&Domain::User].unmatched_frees, 0);
}

#[test]
fn munmap_of_a_head_a_tail_or_a_hole_frees_those_bytes_and_the_mapping_once() {
    const MIB: u64 = 1 << 20;
    let unmap = |ts: u64, ptr: u64, len: u64| {
        let mut e = free(ts, 1, 1, Kind::Munmap, ptr);
        if let Event::Free(f) = &mut e {
            f.arg = (len / 4096) as u32;
        }
        e
    };
    let (x, y, z) = (0x1000_0000, 0x2000_0000, 0x3000_0000);
    let mut events = vec![
        alloc(1, 1, 1, Kind::Mmap, x, 8 * MIB, 8 * MIB, 1),
        alloc(2, 1, 1, Kind::Mmap, y, 8 * MIB, 8 * MIB, 1),
        alloc(3, 1, 1, Kind::Mmap, z, 8 * MIB, 8 * MIB, 1),
        unmap(4, x, 2 * MIB),
        unmap(5, y + 6 * MIB, 2 * MIB),
        unmap(6, z + 3 * MIB, 2 * MIB),
        alloc(7, 1, 1, Kind::Mmap, 0x4000_0000, 2 * MIB, 2 * MIB, 1),
    ];
    let a = run(&events);
    let g = &a.groups[1];
    assert_eq!((g.allocs, g.frees, g.live_allocs), (4, 0, 4));
    assert_eq!((g.live_bytes_req, g.live_bytes_alloc), (20 * MIB, 20 * MIB));
    assert_eq!(a.peak.peaks()[&Domain::User].live_bytes_req, 24 * MIB);
    events.push(unmap(8, z, 8 * MIB));
    events.push(unmap(9, x, 8 * MIB));
    let a = run(&events);
    let g = &a.groups[1];
    assert_eq!((g.frees, g.live_allocs, g.live_bytes_req), (2, 2, 8 * MIB));
    assert_eq!(g.lifetimes.count(), 2);
    assert_eq!(a.live_blocks().map(|b| b.bytes_req).sum::<u64>(), 8 * MIB);
}

#[test]
fn a_free_right_after_the_allocation_is_temporary() {
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        free(2, 1, 1, Kind::Free, 0x1000), // temporary
        alloc(3, 1, 1, Kind::Malloc, 0x2000, 8, 24, 1),
        alloc(4, 1, 1, Kind::Malloc, 0x3000, 8, 24, 1),
        free(5, 1, 1, Kind::Free, 0x2000), // not: another allocation came between
    ]);
    assert_eq!(a.groups[1].temporary, 1);
    assert_eq!(a.groups[1].frees, 2);
}

/// The kernel allocating on the thread's behalf in between (the page its first touch of
/// the block faults in) leaves the block temporary: a thread's user and kernel allocations
/// are followed apart.
#[test]
fn a_kernel_allocation_in_between_leaves_a_block_temporary() {
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        alloc(2, 1, 1, Kind::Kmalloc, 0xffff_0000, 64, 64, 2),
        free(3, 1, 1, Kind::Free, 0x1000),       // temporary
        free(4, 1, 1, Kind::Kfree, 0xffff_0000), // temporary too, among the kernel's
    ]);
    assert_eq!((a.groups[1].temporary, a.groups[2].temporary), (1, 1));
}

#[test]
fn a_mapping_replaced_whole_is_freed_not_missed() {
    // MAP_FIXED over a live mapping: the kernel unmapped it.
    let a =
        run(&[alloc(1, 1, 1, Kind::Mmap, 0x10000, 4096, 4096, 1), alloc(5, 1, 1, Kind::Mmap, 0x10000, 4096, 4096, 2)]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.missed_frees, user.stats.frees, user.stats.live_allocs), (0, 1, 1));
    assert_eq!(user.stats.lifetimes.count(), 1);
}

#[test]
fn an_allocation_over_a_live_block_retires_it() {
    let a = run(&[alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1), alloc(2, 1, 1, Kind::Malloc, 0x1000, 8, 24, 2)]);
    assert_eq!(a.totals[&Domain::User].missed_frees, 1);
    assert_eq!(a.groups[1].live_allocs, 0);
    assert_eq!(a.totals[&Domain::User].stats.live_allocs, 1);
}

#[test]
fn peak_live_bytes_is_the_high_water_mark() {
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 100, 112, 1),
        alloc(2, 1, 1, Kind::Malloc, 0x2000, 50, 56, 1),
        free(3, 1, 1, Kind::Free, 0x1000),
        alloc(4, 1, 1, Kind::Malloc, 0x3000, 20, 24, 1),
    ]);
    assert_eq!(a.groups[1].peak_live_bytes_req, 150);
    assert_eq!(a.groups[1].live_bytes_req, 70);
}

#[test]
fn the_allocator_releasing_its_cache_is_not_an_unmatched_free() {
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        free(2, 1, 1, Kind::Free, 0x1000),
        // glibc's tcache teardown at thread exit frees the cached chunk again.
        free(3, 1, 1, Kind::Free, 0x1000),
        // Reallocated, freed, and an unknown block.
        alloc(4, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        free(5, 1, 1, Kind::Free, 0x1000),
        free(6, 1, 1, Kind::Free, 0x2000),
    ]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.allocator_frees, user.unmatched_frees, user.stats.frees), (1, 1, 2));
}

#[test]
fn frees_after_a_threads_last_allocation_before_it_exits_are_the_allocators() {
    let mut thread_exit = exit(9, 1);
    if let Event::Task(t) = &mut thread_exit {
        t.tid = 2;
        t.flags = 0;
    }
    let a = run(&[
        alloc(1, 1, 2, Kind::Malloc, 0x1000, 8, 24, 1),
        free(2, 1, 2, Kind::Free, 0x5000), // unknown, then the thread allocates: unmatched
        alloc(3, 1, 2, Kind::Malloc, 0x2000, 8, 24, 1),
        free(4, 1, 2, Kind::Free, 0x6000), // unknown, then the thread exits: allocator's
        free(5, 1, 2, Kind::Free, 0x7000),
        thread_exit,
        free(10, 1, 3, Kind::Free, 0x8000), // unknown, thread 3 never exits: unmatched
    ]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.unmatched_frees, user.allocator_frees), (2, 2));
}

/// A process's main thread releases no per-thread cache as it exits: the frees after its
/// last allocation (a process attached with `--pid` freeing, as it shuts down, blocks it
/// allocated before) are frees without allocation, as when it lives on.
#[test]
fn frees_after_the_main_threads_last_allocation_stay_unmatched() {
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        free(2, 1, 1, Kind::Free, 0x5000),
        free(3, 1, 1, Kind::Free, 0x6000),
        exit(9, 1),
    ]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.unmatched_frees, user.allocator_frees), (2, 0));
    assert_eq!(a.unmatched_by_pid.get(&1), Some(&2));
}

#[test]
fn beyond_the_live_limit_allocations_are_counted_not_followed() {
    let mut a = by_stack();
    a.live_limit = 2;
    for i in 0..5u64 {
        a.push(&alloc(i, 1, 1, Kind::Malloc, 0x1000 * (i + 1), 10, 16, 1));
    }
    a.push(&free(10, 1, 1, Kind::Free, 0x1000)); // followed: frees a slot
    a.push(&alloc(11, 1, 1, Kind::Malloc, 0x9000, 10, 16, 1)); // fits again
    a.finish();
    assert_eq!(a.untracked, 3);
    let s = &a.groups[1];
    assert_eq!((s.allocs, s.bytes_req, s.live_allocs, s.frees), (6, 60, 2, 1));
    assert_eq!(a.live_blocks().count(), 2);
}

#[test]
fn sampled_allocations_stand_for_the_ones_not_sampled() {
    // Each byte sampled with probability 1/1000: a 10-byte block is sampled ~1% of the
    // time, so each sampled one stands for ~100; a 1 MB block always, standing for itself.
    let n = 20_000u64;
    let total: u64 = (0..n).map(|i| super::sample_multiplicity(10, 1000, i)).sum();
    let expected = n as f64 / (1.0 - (-10.0f64 / 1000.0).exp());
    assert!((total as f64 - expected).abs() / expected < 0.001, "{total} vs {expected}");
    assert_eq!(super::sample_multiplicity(1 << 20, 1000, 7), 1);

    let mut a = by_stack();
    a.sample_bytes = Some(1000);
    a.push(&alloc(1, 1, 1, Kind::Malloc, 0x1000, 10, 24, 1));
    let count = a.groups[1].allocs;
    assert!((100..=101).contains(&count), "{count}");
    assert_eq!(a.groups[1].bytes_req, 10 * count);
    a.push(&free(2, 1, 1, Kind::Free, 0x1000));
    assert_eq!((a.groups[1].frees, a.groups[1].live_allocs, a.groups[1].live_bytes_req), (count, 0, 0));
}

#[test]
fn each_group_is_read_at_its_domains_peak() {
    let mut a = by_stack();
    a.timeline = Some(Timeline::new(0, 30, true));
    for e in [
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 800, 816, 1), // group 1: 800, freed before the peak
        free(2, 1, 1, Kind::Free, 0x1000),
        alloc(3, 1, 1, Kind::Malloc, 0x2000, 300, 304, 2),
        alloc(4, 1, 1, Kind::Calloc, 0x3000, 700, 704, 3), // the peak: 1000 at 4
        free(5, 1, 1, Kind::Free, 0x3000),
        alloc(6, 1, 1, Kind::Malloc, 0x4000, 600, 608, 4), // 900: below
        alloc(7, 0, 0, Kind::Kmalloc, 0xffff_0000, 64, 64, 5),
        exit(8, 1), // the process's blocks stop counting for the peak (not for the leaks)
        alloc(9, 2, 2, Kind::Malloc, 0x1000, 950, 960, 6), // another process: 950 < 1000
    ] {
        a.push(&e);
    }
    a.finish();
    let at_peak: Vec<u64> = (1..=6).map(|g| a.groups[g].live_bytes_req_at_peak).collect();
    assert_eq!(at_peak, [0, 300, 700, 0, 64, 0]);
    assert_eq!((a.groups[2].live_allocs_at_peak, a.groups[1].peak_live_bytes_req), (1, 800));
    let user = &a.totals[&Domain::User].stats;
    assert_eq!((user.peak_live_bytes_req, user.live_bytes_req_at_peak, user.live_allocs_at_peak), (1000, 1000, 2));
    assert_eq!(user.live_bytes_req, 300 + 600 + 950, "still live (leaked) at the end");
    assert_eq!(a.peak.peaks()[&Domain::User].ts_ns, 4);
    let sizes: Vec<(u64, u64)> = user.sizes.bins().map(|b| (b.max_size, b.allocs)).collect();
    assert_eq!(sizes, [(512, 1), (1024, 4)]);
    let t = a.timeline.as_mut().unwrap();
    assert_eq!(t.interval_ns, 1);
    let n = t.intervals_until(9);
    assert_eq!(t.domains[&Domain::User].dense(n), [0, 800, 800, 300, 1000, 1000, 900, 900, 900, 950]);
    assert_eq!(t.processes[&1].dense(n)[8..], [900, 0], "gone at exit");
    assert_eq!(t.group(3).unwrap().dense(n), [0, 0, 0, 0, 700, 700, 0, 0, 0, 0]);
}

#[test]
fn gpu_blocks_pair_in_their_own_spaces_and_failures_are_not_allocations() {
    let handle = 0x1000; // the same number as a heap pointer: another space
    let mut failed = alloc(9, 1, 1, Kind::GpuDevice, 2, 1 << 50, 1 << 50, 3);
    if let Event::Alloc(a) = &mut failed {
        a.flags = flags::FAILED;
    }
    let unmap =
        Event::Free(Free { ts_ns: 8, pid: 1, tid: 1, cpu: 0, kind: Kind::GpuUnmap, flags: 0, ptr: 0xa000, arg: 1024 });
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, handle, 16, 16, 1),
        alloc(2, 1, 1, Kind::GpuPhysical, handle, 2 << 20, 2 << 20, 2),
        alloc(3, 1, 1, Kind::GpuPitched, 0x7f00, 64000, 65536, 2),
        alloc(4, 1, 1, Kind::GpuReserve, 0xa000, 8 << 20, 8 << 20, 4),
        alloc(5, 1, 1, Kind::GpuMap, 0xa000, 2 << 20, 2 << 20, 4),
        alloc(6, 1, 1, Kind::GpuMap, 0xa000 + (2 << 20), 2 << 20, 2 << 20, 4),
        free(7, 1, 1, Kind::GpuRelease, handle),
        unmap, // 4 MiB from 0xa000: both mappings
        failed,
        free(10, 1, 1, Kind::GpuFree, 0x7f00),
    ]);
    let user = &a.totals[&Domain::User].stats;
    assert_eq!((user.allocs, user.live_allocs), (1, 1), "the heap block is untouched");
    let gpu = &a.totals[&Domain::Gpu];
    assert_eq!((gpu.stats.allocs, gpu.stats.frees, gpu.stats.live_allocs), (2, 2, 0));
    assert_eq!(gpu.stats.bytes_req, (2 << 20) + 64000);
    assert_eq!(gpu.stats.bytes_alloc, (2 << 20) + 65536);
    assert_eq!((gpu.stats.failed, gpu.stats.failed_bytes_req), (1, 1 << 50));
    assert_eq!(gpu.unmatched_frees, 0);
    let va = &a.totals[&Domain::GpuAddress].stats;
    assert_eq!((va.allocs, va.frees, va.live_allocs, va.live_bytes_req), (3, 2, 1, 8 << 20));
    assert_eq!(a.groups[3].failed, 1);
    assert_eq!(a.groups[3].allocs, 0);
}

fn task(ts: u64, event: TaskEvent, pid: u32, ppid: u32) -> Event {
    Event::Task(Task { ts_ns: ts, event, flags: 0, pid, tid: pid, ppid, comm: String::new(), filename: String::new() })
}

#[test]
fn a_child_of_a_process_running_before_tracing_frees_its_unseen_blocks_as_inherited() {
    // pid 1 was running when tracing began (record -a, --pid): a subshell frees blocks
    // the shell allocated before; after its exec nothing is inherited.
    let a = run(&[
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        task(2, TaskEvent::Fork, 2, 1),
        free(3, 2, 2, Kind::Free, 0x9000),
        free(4, 1, 1, Kind::Free, 0x8000),
        task(5, TaskEvent::Exec, 2, 0),
        free(6, 2, 2, Kind::Free, 0x7000),
    ]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.inherited_frees, user.unmatched_frees), (1, 2), "{user:?}");
    assert_eq!((a.unmatched_by_pid.get(&1), a.unmatched_by_pid.get(&2)), (Some(&1), Some(&1)));
}

#[test]
fn a_forked_child_freeing_its_parents_blocks_is_not_an_unmatched_free() {
    let a = run(&[
        // pid 1 started while traced (the command's exec): its blocks are all seen.
        task(0, TaskEvent::Exec, 1, 0),
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        alloc(2, 1, 1, Kind::Malloc, 0x2000, 8, 24, 1),
        alloc(3, 1, 1, Kind::Malloc, 0x3000, 8, 24, 1),
        free(4, 1, 1, Kind::Free, 0x3000),
        task(5, TaskEvent::Fork, 2, 1),
        // The parent allocates after the fork: not the child's.
        alloc(6, 1, 1, Kind::Malloc, 0x4000, 8, 24, 1),
        // The child frees its copies of blocks from before the fork (one the parent has
        // freed since), a block the parent allocated after it, and one nobody allocated.
        free(7, 2, 2, Kind::Free, 0x1000),
        free(8, 1, 1, Kind::Free, 0x2000),
        free(9, 2, 2, Kind::Free, 0x2000),
        free(10, 2, 2, Kind::Free, 0x4000),
        free(11, 2, 2, Kind::Free, 0x9000),
        // After an exec the child's space is its own: nothing is inherited.
        task(12, TaskEvent::Exec, 2, 0),
        free(13, 2, 2, Kind::Free, 0x1000),
    ]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.inherited_frees, user.unmatched_frees), (2, 3), "{user:?}");
    // The parent's blocks stay the parent's: 0x1000 still live there, 0x2000 freed once.
    assert_eq!((user.stats.frees, user.stats.live_allocs), (2, 2));
    assert_eq!(a.unmatched_by_pid.get(&2), Some(&3));
}

#[test]
fn a_vfork_child_allocates_in_its_parents_heap_until_it_execs() {
    let vfork = |ts: u64, pid: u32, ppid: u32| match task(ts, TaskEvent::Fork, pid, ppid) {
        Event::Task(t) => Event::Task(Task { flags: flags::SHARED_MEMORY, ..t }),
        _ => unreachable!(),
    };
    let events = [
        task(0, TaskEvent::Exec, 1, 0),
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        vfork(2, 2, 1),
        // The child allocates in the shared heap, and frees a block of its parent's.
        alloc(3, 2, 2, Kind::Malloc, 0x2000, 8, 24, 2),
        free(4, 2, 2, Kind::Free, 0x1000),
        // Its exec leaves the shared heap to the parent, which frees the child's block.
        task(5, TaskEvent::Exec, 2, 0),
        free(6, 1, 1, Kind::Free, 0x2000),
        // The child's own heap now: a block it did not allocate there is unmatched.
        free(7, 2, 2, Kind::Free, 0x2000),
    ];
    let a = run(&events);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.stats.allocs, user.stats.frees, user.stats.live_allocs), (2, 2, 0), "{user:?}");
    assert_eq!((user.inherited_frees, user.unmatched_frees), (0, 1), "{user:?}");
    assert_eq!(a.unmatched_by_pid.get(&2), Some(&1));
    // The report's per-process warnings count alike.
    let mut u = super::unmatched::UnmatchedFrees::new(None);
    for e in &events {
        u.push(e);
    }
    u.finish();
    assert_eq!(u.by_pid, a.unmatched_by_pid);
}

#[test]
fn a_grandchild_freeing_its_grandparents_blocks_is_not_an_unmatched_free() {
    let a = run(&[
        // pid 1 started while traced (the command's exec): its blocks are all seen.
        task(0, TaskEvent::Exec, 1, 0),
        alloc(1, 1, 1, Kind::Malloc, 0x1000, 8, 24, 1),
        // The middle process allocates nothing of its own before or after forking.
        task(2, TaskEvent::Fork, 2, 1),
        alloc(3, 1, 1, Kind::Malloc, 0x2000, 8, 24, 1), // after the first fork: not copied
        task(4, TaskEvent::Fork, 3, 2),
        free(5, 3, 3, Kind::Free, 0x1000),
        free(6, 3, 3, Kind::Free, 0x2000),
        // A great-grandchild of a middle that allocated one block before forking.
        alloc(7, 3, 3, Kind::Malloc, 0x5000, 8, 24, 2),
        task(8, TaskEvent::Fork, 4, 3),
        free(9, 4, 4, Kind::Free, 0x1000),
        free(10, 4, 4, Kind::Free, 0x5000),
    ]);
    let user = &a.totals[&Domain::User];
    assert_eq!((user.inherited_frees, user.unmatched_frees), (3, 1), "{user:?}");
    assert_eq!(a.unmatched_by_pid.get(&3), Some(&1));
    assert_eq!((user.stats.frees, user.stats.live_allocs), (0, 3));
}

/// The memory the allocator reserved for itself (an mmap whose stack is the allocator's own)
/// counts in its own domain's peak and timeline, not in the user's, as in every other figure.
#[test]
fn reserved_mmaps_are_not_in_the_users_peak() {
    let mut a = by_stack();
    a.reserved_stacks = [9].into();
    a.timeline = Some(Timeline::new(0, 10, true));
    for e in [
        alloc(1, 1, 1, Kind::Mmap, 0x7000_0000, 1 << 20, 1 << 20, 9),
        alloc(2, 1, 1, Kind::Malloc, 0x1000, 100, 112, 1),
        alloc(3, 1, 1, Kind::Mmap, 0x7100_0000, 4096, 4096, 2),
    ] {
        a.push(&e);
    }
    a.finish();
    let peaks = a.peak.peaks();
    assert_eq!(peaks[&Domain::User].live_bytes_req, 100 + 4096);
    assert_eq!(peaks[&Domain::Reserved].live_bytes_req, 1 << 20);
    assert_eq!(a.totals[&Domain::User].stats.peak_live_bytes_req, 100 + 4096);
    let t = a.timeline.as_mut().unwrap();
    let n = t.intervals_until(3);
    assert_eq!(*t.domains[&Domain::User].dense(n).last().unwrap(), 100 + 4096);
}
