//! The models against tables the real libraries produced (Debian bookworm amd64:
//! libjemalloc2 5.3.0-1, libmimalloc2.0 2.0.9+ds-2, libtcmalloc-minimal4 2.10-1), written by
//! `tests/programs/usable_sizes.c`: one line "API ALIGN SIZE USABLE" wherever the usable size
//! of a fresh block changes as SIZE grows by one byte from 0 to 4 MiB.
use memtrace_common::Kind;

use super::{Family, usable::Model};

const LAST: u64 = 4 << 20;

/// (api, alignment) and its step function: (first size, usable) pairs.
type Table = ((String, u64), Vec<(u64, u64)>);

/// The step functions of a table, one per (api, align).
fn steps(table: &str) -> Vec<Table> {
    let mut out: Vec<Table> = Vec::new();
    for line in table.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let key = (f[0].to_string(), f[1].parse().unwrap());
        let step = (f[2].parse().unwrap(), f[3].parse().unwrap());
        match out.last_mut() {
            Some((k, v)) if *k == key => v.push(step),
            _ => out.push((key, vec![step])),
        }
    }
    out
}

fn kind_of(api: &str) -> Kind {
    match api {
        "malloc" => Kind::Malloc,
        "posix_memalign" => Kind::PosixMemalign,
        "memalign" => Kind::Memalign,
        "aligned_alloc" => Kind::AlignedAlloc,
        other => panic!("api {other}"),
    }
}

/// Every size from 0 to 4 MiB: the model equals the library.
fn check(family: Family, table: &str) {
    let model = Model::for_family(family, None);
    let tables = steps(table);
    assert!(!tables.is_empty());
    for ((api, align), steps) in tables {
        let kind = kind_of(&api);
        let mut checked = 0;
        for (i, &(from, want)) in steps.iter().enumerate() {
            let to = steps.get(i + 1).map_or(LAST + 1, |s| s.0);
            for size in from..to {
                let got = model.usable(kind, size, align, None);
                assert_eq!(got, Some(want), "{family:?} {api}({size}, align {align})");
                checked += 1;
            }
        }
        assert_eq!(checked, LAST + 1, "{api} {align}: the table covers 0..=4 MiB");
    }
}

#[test]
fn jemalloc_equals_the_library_for_every_size_to_4_mib() {
    check(Family::Jemalloc, include_str!("testdata/jemalloc.txt"));
}

#[test]
fn tcmalloc_equals_the_library_for_every_size_to_4_mib() {
    check(Family::Tcmalloc, include_str!("testdata/tcmalloc.txt"));
}

#[test]
fn mimalloc_equals_the_library_for_every_size_to_4_mib() {
    check(Family::Mimalloc, include_str!("testdata/mimalloc.txt"));
}

#[test]
fn tcmalloc_has_85_classes_by_default_and_follows_the_environment() {
    assert_eq!(super::tcmalloc::class_sizes(32).len(), 85);
    assert_eq!(super::tcmalloc::class_sizes(512).len(), 87);
}

#[test]
fn unknown_and_glibc_are_left_as_recorded_and_musl_is_the_request() {
    assert_eq!(Model::for_family(Family::Unknown, None).usable(Kind::Malloc, 10, 0, None), None);
    assert_eq!(Model::for_family(Family::Glibc, None).usable(Kind::Malloc, 10, 0, None), None);
    assert_eq!(Model::for_family(Family::Musl, None).usable(Kind::Malloc, 10, 0, None), Some(10));
}

#[test]
fn reallocs_follow_the_old_block_where_the_family_does() {
    let tc = Model::for_family(Family::Tcmalloc, None);
    // tcmalloc grows by at least a quarter: 1000 → 1100 gets the class of 1250.
    assert_eq!(tc.usable(Kind::Realloc, 1100, 0, Some(Some(1024))), Some(1280));
    // shrinking to no less than half stays in place
    assert_eq!(tc.usable(Kind::Realloc, 600, 0, Some(Some(1024))), Some(1024));
    assert_eq!(tc.usable(Kind::Realloc, 600, 0, Some(None)), None);
    let mi = Model::for_family(Family::Mimalloc, None);
    assert_eq!(mi.usable(Kind::Realloc, 600, 0, Some(Some(1024))), Some(1024));
    assert_eq!(mi.usable(Kind::Realloc, 300, 0, Some(Some(1024))), Some(320));
    // mimalloc's aligned blocks depend on the heap: unknown, except where they do not
    assert_eq!(mi.usable(Kind::PosixMemalign, 100, 64, None), None);
    assert_eq!(mi.usable(Kind::PosixMemalign, 256, 64, None), Some(256));
}

#[test]
fn a_free_seen_by_two_probes_is_reported_once_but_a_reused_block_frees_again() {
    use crate::event::{Alloc, Event, Free};
    use memtrace_common::flags;
    let alloc = |ptr: u64, tid: u32| {
        Event::Alloc(Alloc {
            ts_ns: 0,
            pid: 1,
            tid,
            cpu: 0,
            kind: Kind::Malloc,
            flags: flags::USABLE_EXACT,
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
        })
    };
    let free = |ptr: u64, tid: u32| {
        Event::Free(Free { ts_ns: 0, pid: 1, tid, cpu: 0, kind: Kind::Free, flags: 0, ptr, arg: 0 })
    };
    let mut u = super::usable::UsableSizes::default();
    let mut keep = |e: Event| u.apply(&mut e.clone());
    assert!(keep(alloc(0x10, 1)));
    assert!(keep(free(0x10, 1)));
    assert!(!keep(free(0x10, 1)), "the same free through a second probe");
    // reallocated (by another thread) and freed again: a new free
    assert!(keep(alloc(0x10, 2)));
    assert!(keep(free(0x10, 1)));
    // another thread's free of the same address is its own
    assert!(keep(alloc(0x10, 1)));
    assert!(keep(free(0x10, 2)));
    // the program's own double free, later: kept
    let mut later = free(0x10, 2);
    if let Event::Free(f) = &mut later {
        f.ts_ns = 1_000_000;
    }
    assert!(keep(later));
}
