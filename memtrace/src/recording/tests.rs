//! Round trips, truncation and corruption of the recording format.
use memtrace_common::{Kind, TaskEvent, flags};
use proptest::prelude::*;

use super::*;
use crate::event::{Alloc, Event, Free, Task};

fn meta() -> Meta {
    Meta { memtrace_version: "test".into(), mode: "pid".into(), target_pids: vec![42], ..Default::default() }
}

fn alloc(ts: u64, kind: Kind, ptr: u64, req: u64) -> Event {
    Event::Alloc(Alloc {
        ts_ns: ts,
        pid: 42,
        tid: 43,
        cpu: if kind.is_kernel() { 1 } else { 0 },
        kind,
        flags: flags::USABLE_EXACT,
        ptr,
        bytes_req: req,
        bytes_alloc: req + 8,
        stack: 3,
        call_site: if kind.is_kernel() { 0xffff_ffff_8123_4567 } else { 0 },
        gfp_flags: if kind.is_kernel() { 0xcc0 } else { 0 },
        node: -1,
        order: 0,
        allocator: 0,
    })
}

fn free(ts: u64, kind: Kind, ptr: u64) -> Event {
    Event::Free(Free {
        ts_ns: ts,
        pid: 42,
        tid: 44,
        cpu: if kind.is_kernel() { 1 } else { 0 },
        kind,
        flags: 0,
        ptr,
        arg: 0,
    })
}

fn sample_events() -> Vec<Event> {
    vec![
        Event::Task(Task {
            ts_ns: 1_000,
            event: TaskEvent::Exec,
            flags: 0,
            pid: 42,
            tid: 42,
            ppid: 0,
            comm: "prog".into(),
            filename: "/usr/bin/prog".into(),
        }),
        alloc(1_500, Kind::Malloc, 0x5555_0000_1000, 24),
        alloc(1_600, Kind::Kmalloc, 0xffff_8880_0000_1000, 64),
        free(1_700, Kind::Free, 0x5555_0000_1000),
        alloc(1_800, Kind::Calloc, 0x5555_0000_0f00, 100),
        free(1_900, Kind::Kfree, 0xffff_8880_0000_1000),
        alloc(2_000, Kind::PageAlloc, 0x12345, 4096),
    ]
}

fn write(events: &[Event], finish: bool) -> Vec<u8> {
    let mut w = Writer::new(Vec::new(), &meta()).unwrap();
    w.module(&Module { id: 0, build_id: vec![1; 20], path: "/usr/bin/prog".into() });
    w.stack(&FileStack {
        id: 3,
        pid: 42,
        kernel: vec![0xffff_ffff_8100_0010, 0xffff_ffff_8100_0000],
        user: vec![FileFrame::Module { module: 0, offset: 0x1234 }, FileFrame::Address(0x7f00_0000_0000)],
        truncated: true,
    });
    w.symbol(
        SymbolKey::User(FileFrame::Module { module: 0, offset: 0x1234 }),
        &[
            Symbol { name: "inlined_helper".into(), file: Some("a.c".into()), line: 7, inlined: true },
            Symbol { name: "main".into(), file: None, line: 0, inlined: false },
        ],
    );
    for e in events {
        w.event(e).unwrap();
    }
    let stats = Stats { lost_events: 2, events: events.len() as u64, ..Default::default() };
    if finish { w.finish(&stats).unwrap() } else { w.into_inner().unwrap() }
}

#[test]
fn round_trips_every_chunk() {
    let events = sample_events();
    let rec = read_all(&write(&events, true)[..]).unwrap();
    assert_eq!(rec.meta, meta());
    assert_eq!(rec.events, events);
    assert!(rec.finalized);
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.stats.lost_events, 2);
    assert_eq!(rec.stacks[&3].kernel, [0xffff_ffff_8100_0010, 0xffff_ffff_8100_0000]);
    assert_eq!(rec.modules[&0].path, "/usr/bin/prog");
    let key = SymbolKey::User(FileFrame::Module { module: 0, offset: 0x1234 });
    assert_eq!(rec.symbols[&key][0].name, "inlined_helper");
    assert!(rec.symbols[&key][0].inlined);
}

#[test]
fn every_truncation_reads_the_complete_part_or_fails_cleanly() {
    let events = sample_events();
    let bytes = write(&events, true);
    let meta_end = HEADER_LEN + 9 + serde_json::to_vec(&meta()).unwrap().len();
    for len in 0..bytes.len() {
        match read_all(&bytes[..len]) {
            Ok(rec) => {
                assert!(events.starts_with(&rec.events), "at {len}");
                assert!(!rec.finalized);
                assert!(!rec.warnings.is_empty(), "a truncated file must warn (at {len})");
            }
            Err(FormatError::NotMemtrace | FormatError::Truncated { .. }) => {
                assert!(len < meta_end, "at {len}")
            }
            Err(e) => panic!("unexpected error at {len}: {e}"),
        }
    }
}

#[test]
fn a_flipped_byte_is_caught_by_the_checksum() {
    let bytes = write(&sample_events(), true);
    let mut damaged = bytes.clone();
    let at = bytes.len() - 40;
    damaged[at] ^= 0x55;
    let rec = read_all(&damaged[..]).unwrap();
    assert!(rec.warnings.iter().any(|w| w.contains("corrupt")), "{:?}", rec.warnings);
}

#[test]
fn foreign_files_and_newer_versions_are_refused() {
    assert!(matches!(read_all(&b"\x7fELF\x02\x01\x01"[..]), Err(FormatError::NotMemtrace)));
    assert!(matches!(read_all(&[][..]), Err(FormatError::NotMemtrace)));
    let mut newer = write(&[], true);
    newer[8..10].copy_from_slice(&(VERSION + 1).to_le_bytes());
    assert!(matches!(read_all(&newer[..]), Err(FormatError::UnsupportedVersion(v)) if v == VERSION + 1));
}

#[test]
fn events_cost_few_bytes_each() {
    let mut events = Vec::new();
    for i in 0..10_000u64 {
        events.push(alloc(1_000 + i * 50, Kind::Malloc, 0x5555_0000_0000 + (i % 64) * 48, 24 + i % 5));
        events.push(free(1_025 + i * 50, Kind::Free, 0x5555_0000_0000 + (i % 64) * 48));
    }
    let bytes = write(&events, true);
    let per_event = bytes.len() as f64 / events.len() as f64;
    assert!(per_event < 12.0, "{per_event} bytes per event");
}

fn arb_event() -> impl Strategy<Value = Event> {
    let kinds = prop::sample::select(vec![
        Kind::Malloc,
        Kind::Calloc,
        Kind::Realloc,
        Kind::Mmap,
        Kind::Free,
        Kind::Munmap,
        Kind::Kmalloc,
        Kind::KmemCacheAlloc,
        Kind::PageAlloc,
        Kind::Kfree,
        Kind::PageFree,
    ]);
    (
        kinds,
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u16>(),
        any::<u8>(),
        any::<u64>(),
    )
        .prop_map(|(kind, ts, ptr, pid, tid, req, cpu, fl, extra)| {
            let cpu = if kind.is_kernel() { cpu } else { 0 };
            if kind.is_free() {
                Event::Free(Free { ts_ns: ts, pid, tid, cpu, kind, flags: fl, ptr, arg: extra as u32 })
            } else {
                Event::Alloc(Alloc {
                    ts_ns: ts,
                    pid,
                    tid,
                    cpu,
                    kind,
                    // bit 6 of a user allocation's flags is the recording's own (an
                    // allocator index follows); the probes never set it
                    flags: if kind.is_kernel() { fl } else { fl & !(1 << 6) },
                    ptr,
                    bytes_req: req,
                    bytes_alloc: req.wrapping_add(extra % 4096),
                    stack: extra,
                    call_site: if kind.is_kernel() { extra } else { 0 },
                    gfp_flags: if kind.is_kernel() { extra as u32 } else { 0 },
                    node: if kind.is_kernel() { extra as i32 } else { -1 },
                    order: if kind.is_kernel() { fl } else { 0 },
                    allocator: if kind.is_kernel() { 0 } else { fl },
                })
            }
        })
}

proptest! {
    #[test]
    fn any_event_sequence_round_trips(events in prop::collection::vec(arb_event(), 0..200)) {
        let rec = read_all(&write(&events, true)[..]).unwrap();
        prop_assert_eq!(rec.events, events);
    }

    /// The bounded fuzz run of the parser: arbitrary bytes after a valid header and
    /// arbitrary mutations of a valid file never panic.
    #[test]
    fn the_reader_never_panics(noise in prop::collection::vec(any::<u8>(), 0..512), at in any::<usize>(), byte in any::<u8>()) {
        let mut bytes = write(&sample_events(), true);
        let i = at % bytes.len();
        bytes[i] = byte;
        let _ = read_all(&bytes[..]);
        let mut with_noise = write(&[], false);
        with_noise.extend(&noise);
        let _ = read_all(&with_noise[..]);
        let _ = read_all(&noise[..]);
    }
}

#[test]
fn no_event_flag_is_the_recordings_own_allocator_bit() {
    use memtrace_common::flags::*;
    for bit in [USABLE_EXACT, BY_REALLOC, IRQ, HAS_STACK, FOREIGN_FREE, GROUP_DEAD, FAILED] {
        assert_eq!(bit & super::events::ALLOCATOR_FOLLOWS, 0, "{bit:#x}");
    }
}

#[test]
fn gpu_events_round_trip_with_their_device() {
    let mut physical = alloc(1_000, Kind::GpuPhysical, 0x1000, 2 << 20);
    let mut failed = alloc(1_100, Kind::GpuDevice, 2, 1 << 50);
    if let (Event::Alloc(p), Event::Alloc(f)) = (&mut physical, &mut failed) {
        p.node = 3;
        f.flags = flags::FAILED | flags::HAS_STACK;
        f.bytes_alloc = f.bytes_req;
    }
    let events = vec![
        physical,
        failed,
        alloc(1_200, Kind::GpuMap, 0x7d00_0000_0000, 2 << 20),
        free(1_300, Kind::GpuUnmap, 0x7d00_0000_0000),
        free(1_400, Kind::GpuRelease, 0x1000),
        alloc(1_500, Kind::Malloc, 0x5555_0000_1000, 24),
    ];
    let rec = read_all(&write(&events, true)[..]).unwrap();
    assert_eq!(rec.events, events);
}
