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

/// The chunks of a recording as stored: (kind byte, payload).
fn stored_chunks(bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = HEADER_LEN;
    while at + 9 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        out.push((bytes[at], bytes[at + 9..at + 9 + len].to_vec()));
        at += 9 + len;
    }
    out
}

/// A recording made of `chunks` behind a header of `version`.
fn assemble(version: u16, chunks: &[(u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = write(&[], false)[..HEADER_LEN].to_vec();
    out[8..10].copy_from_slice(&version.to_le_bytes());
    for (kind, payload) in chunks {
        out.push(*kind);
        out.extend((payload.len() as u32).to_le_bytes());
        out.extend(crc32fast::hash(payload).to_le_bytes());
        out.extend(payload);
    }
    out
}

fn many_events() -> Vec<Event> {
    let mut events = Vec::new();
    for i in 0..10_000u64 {
        events.push(alloc(1_000 + i * 50, Kind::Malloc, 0x5555_0000_0000 + (i % 64) * 48, 24 + i % 5));
        events.push(free(1_025 + i * 50, Kind::Free, 0x5555_0000_0000 + (i % 64) * 48));
    }
    events
}

#[test]
fn growing_chunks_are_deflated_and_read_back() {
    let events = many_events();
    let mut w = Writer::new(Vec::new(), &meta()).unwrap();
    // Stacks sharing their callers' frames, as real ones do.
    let callers: Vec<FileFrame> =
        (0..60).map(|i| FileFrame::Module { module: 0, offset: 0x10_000 + i * 0x40 }).collect();
    for id in 0..500u32 {
        let mut user = vec![FileFrame::Module { module: 1, offset: 0x500 + u64::from(id) * 8 }];
        user.extend(&callers);
        w.stack(&FileStack { id, pid: 42, kernel: Vec::new(), user, truncated: false });
    }
    for e in &events {
        w.event(e).unwrap();
    }
    let bytes = w.finish(&Stats::default()).unwrap();
    let kinds: Vec<u8> = stored_chunks(&bytes).iter().map(|c| c.0).collect();
    assert!(kinds.contains(&(ChunkKind::Events as u8 | COMPRESSED)), "{kinds:?}");
    assert!(kinds.contains(&(ChunkKind::Stacks as u8 | COMPRESSED)), "{kinds:?}");
    assert_eq!(kinds[0], ChunkKind::Meta as u8, "the metadata stays readable as it is");
    let rec = read_all(&bytes[..]).unwrap();
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.events, events);
    assert_eq!(rec.stacks.len(), 500);
    assert_eq!(rec.stacks[&7].user[1..], callers[..]);
    // 61 frames × 500 stacks stored raw would be ~100 KB on their own.
    let per_event = bytes.len() as f64 / events.len() as f64;
    assert!(per_event < 3.0, "{per_event} bytes per event");
}

#[test]
fn version_2_recordings_without_compression_are_still_read() {
    let events = many_events();
    let bytes = write(&events, true);
    let stored: Vec<(u8, Vec<u8>)> = stored_chunks(&bytes)
        .into_iter()
        .map(|(kind, payload)| {
            if kind & COMPRESSED == 0 {
                return (kind, payload);
            }
            let mut c = codec::Cursor::new(&payload, 0);
            let len = c.varint().unwrap();
            let mut raw = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::DeflateDecoder::new(c.rest()), &mut raw).unwrap();
            assert_eq!(raw.len() as u64, len);
            (kind & !COMPRESSED, raw)
        })
        .collect();
    let rec = read_all(&assemble(2, &stored)[..]).unwrap();
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert!(rec.finalized);
    assert_eq!(rec.events, events);
}

#[test]
fn a_compressed_chunk_that_lies_about_its_size_is_corrupt() {
    let events = many_events();
    let chunks = stored_chunks(&write(&events, true));
    let meta_chunk = chunks[0].clone();
    let deflate = |raw: &[u8]| {
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut e, raw).unwrap();
        e.finish().unwrap()
    };
    let events_kind = ChunkKind::Events as u8 | COMPRESSED;
    let mut claims_more = Vec::new();
    codec::put_varint(&mut claims_more, 1000);
    claims_more.extend(deflate(&[0u8; 10]));
    let mut claims_less = Vec::new();
    codec::put_varint(&mut claims_less, 5);
    claims_less.extend(deflate(&[0u8; 10]));
    let mut bomb = Vec::new();
    codec::put_varint(&mut bomb, u64::from(MAX_CHUNK) + 1);
    bomb.extend(deflate(&[0u8; 10]));
    let mut garbage = Vec::new();
    codec::put_varint(&mut garbage, 10);
    garbage.extend([0xff; 12]);
    for (what, payload) in [("more", claims_more), ("less", claims_less), ("bomb", bomb), ("garbage", garbage)] {
        let rec = read_all(&assemble(VERSION, &[meta_chunk.clone(), (events_kind, payload)])[..]).unwrap();
        assert!(rec.events.is_empty(), "{what}");
        assert!(rec.warnings.iter().any(|w| w.contains("corrupt")), "{what}: {:?}", rec.warnings);
    }
}
