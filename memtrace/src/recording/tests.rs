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
        cache: 0,
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
    assert_eq!(&*rec.symbols[&key][0].name, "inlined_helper");
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

/// A chunk that fails its checksum is skipped and the chunks after it are read: one flipped
/// bit early in a long recording no longer loses all that follows.
#[test]
fn the_chunks_after_a_damaged_one_are_read() {
    let events = sample_events();
    let mut w = Writer::new(Vec::new(), &meta()).unwrap();
    for e in &events {
        w.event(e).unwrap();
        w.flush().unwrap();
    }
    let bytes = w.finish(&Stats::default()).unwrap();
    let whole = read_all(&bytes[..]).unwrap();
    assert_eq!(whole.events.len(), events.len());
    // The first events chunk's payload: past the header and the metadata chunk.
    let meta_len = u32::from_le_bytes(bytes[HEADER_LEN + 1..HEADER_LEN + 5].try_into().unwrap()) as usize;
    let first = HEADER_LEN + 9 + meta_len;
    let mut damaged = bytes.clone();
    damaged[first + 9] ^= 0x04;
    let rec = read_all(&damaged[..]).unwrap();
    assert!(
        rec.warnings.iter().any(|w| w.contains("checksum mismatch") && w.contains("skipped")),
        "{:?}",
        rec.warnings
    );
    assert!(rec.finalized, "read to its end");
    assert!(!rec.events.is_empty() && rec.events.len() < events.len(), "{} of {}", rec.events.len(), events.len());
    assert_eq!(rec.events[..], whole.events[whole.events.len() - rec.events.len()..]);
    // Damage in the chunk's length: what it leads to is no chunk header, and the reading
    // stops there rather than skipping through the data.
    let mut damaged = bytes.clone();
    damaged[first + 1] ^= 0x01;
    let rec = read_all(&damaged[..]).unwrap();
    assert!(rec.warnings.len() <= 2, "{:?}", rec.warnings);
    assert!(!rec.finalized);
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

/// A chunk's kind byte damaged (to an unknown kind, another kind, or the end marker): the
/// checksum covers it (version 9), so the chunk is skipped and said so, and the chunks
/// after it still read. Before, the events chunk vanished, or the file ended there, in
/// silence (helper-37 finding 3).
#[test]
fn a_damaged_chunk_kind_is_caught_by_the_checksum() {
    let events = sample_events();
    let bytes = write(&events, true);
    // The first events chunk.
    let mut at = HEADER_LEN;
    while bytes[at] & !COMPRESSED != ChunkKind::Events as u8 {
        at += 9 + u32::from_le_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
    }
    for kind in [0x7f, ChunkKind::Stats as u8, ChunkKind::End as u8, bytes[at] ^ 0xff] {
        let mut damaged = bytes.clone();
        damaged[at] = kind;
        let rec = read_all(&damaged[..]).unwrap();
        assert!(
            rec.warnings.iter().any(|w| w.contains(&format!("byte {at}")) && w.contains("skipped")),
            "kind {kind:#x}: {:?}",
            rec.warnings
        );
        assert!(rec.finalized, "the chunks after it read, the end marker too (kind {kind:#x})");
    }
}

#[test]
fn foreign_files_and_newer_versions_are_refused() {
    assert!(matches!(read_all(&b"\x7fELF\x02\x01\x01"[..]), Err(FormatError::NotMemtrace)));
    assert!(matches!(read_all(&[][..]), Err(FormatError::NotMemtrace)));
    // A later memtrace's file: its metadata says so.
    let w = Writer::new(Vec::new(), &Meta { memtrace_version: "99.0.0".into(), ..meta() }).unwrap();
    let mut newer = w.finish(&Stats::default()).unwrap();
    newer[8..10].copy_from_slice(&(VERSION + 1).to_le_bytes());
    assert!(matches!(read_all(&newer[..]), Err(FormatError::UnsupportedVersion(v)) if v == VERSION + 1));
    // A version byte damaged in a file this release wrote: damage, not a newer format.
    let mut damaged = write(&[], true);
    damaged[8..10].copy_from_slice(&0xff08u16.to_le_bytes());
    let err = read_all(&damaged[..]).unwrap_err();
    assert!(matches!(&err, FormatError::Corrupt { offset: 8, .. }), "{err}");
    assert!(err.to_string().contains("damaged header"), "{err}");
    // A later memtrace's file whose metadata changed shape: still told by its writer.
    let json = br#"{"memtrace_version":"99.0.0","targets":[{"pid":42}]}"#;
    let mut reshaped = newer[..HEADER_LEN].to_vec();
    reshaped.push(ChunkKind::Meta as u8);
    reshaped.extend_from_slice(&(json.len() as u32).to_le_bytes());
    let crc = super::chunk_crc(VERSION + 1, ChunkKind::Meta as u8, json.len() as u32, json);
    reshaped.extend_from_slice(&crc.to_le_bytes());
    reshaped.extend_from_slice(json);
    assert!(matches!(read_all(&reshaped[..]), Err(FormatError::UnsupportedVersion(v)) if v == VERSION + 1));
    // No metadata to tell by: both are said.
    let err = read_all(&newer[..HEADER_LEN]).unwrap_err();
    assert!(err.to_string().contains("a newer format, or a damaged header"), "{err}");
    // Every other header byte holds one of a few values: another is damage, at that byte
    // (helper-50: a byte order of 2 → 3, or a reserved byte set, read on in silence).
    let good = write(&[], true);
    assert!(read_all(&good[..]).is_ok());
    for (at, value) in [(10, 3u8), (10, 0), (11, 4), (12, 2), (13, 1), (14, 0x80), (15, 0xff)] {
        let mut damaged = good.clone();
        damaged[at] = value;
        let err = read_all(&damaged[..]).unwrap_err();
        assert!(matches!(&err, FormatError::Corrupt { offset, .. } if *offset == at as u64), "byte {at}: {err}");
    }
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
                    cache: if kind.is_kernel() { extra.rotate_left(7) } else { 0 },
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
        out.extend(super::chunk_crc(version, *kind, payload.len() as u32, payload).to_le_bytes());
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

/// The stack of `write`, and deep stacks sharing their callers.
fn sample_stacks() -> Vec<FileStack> {
    let callers: Vec<FileFrame> =
        (0..40).map(|i| FileFrame::Module { module: 0, offset: 0x10_000 + i * 0x40 }).collect();
    let mut out = Vec::new();
    for id in 0..50u32 {
        let mut user = vec![FileFrame::Module { module: 1, offset: 0x500 + u64::from(id % 7) * 8 }];
        if id % 3 == 0 {
            user.push(FileFrame::Address(0x7f00_0000_0000 + u64::from(id)));
        }
        user.extend(&callers[(id % 2) as usize..]);
        let kernel =
            if id % 4 == 0 { vec![0xffff_ffff_8100_0010 + u64::from(id % 8), 0xffff_ffff_8100_0000] } else { vec![] };
        out.push(FileStack { id: 100 + id, pid: 42 + id % 2, kernel, user, truncated: id % 5 == 0 });
    }
    // One stack the prefix of another (its innermost frame is another's caller), one with
    // kernel frames only, one empty, and one seen twice under two ids.
    out.push(FileStack { id: 200, pid: 42, kernel: vec![], user: callers.clone(), truncated: false });
    out.push(FileStack { id: 201, pid: 42, kernel: vec![0xffff_ffff_8100_0020], user: vec![], truncated: false });
    out.push(FileStack { id: 202, pid: 42, kernel: vec![], user: vec![], truncated: true });
    out.push(FileStack { id: 203, pid: 42, kernel: vec![], user: callers[1..].to_vec(), truncated: false });
    out.push(FileStack { id: 204, pid: 42, kernel: vec![], user: callers[1..].to_vec(), truncated: false });
    out
}

/// The recording `write` makes, in the layout of format version 2 (`deflate: false`) or 3:
/// events one after another, every frame of every stack.
fn older_recording(version: u16, events: &[Event], stacks: &[FileStack], deflate: bool) -> Vec<u8> {
    let mut enc = super::events_rows::EventEncoder::new();
    for e in events {
        enc.push(e);
    }
    let mut stack_bytes = Vec::new();
    for s in stacks {
        super::stacks::encode_flat(&mut stack_bytes, s);
    }
    let pack = |kind: ChunkKind, raw: Vec<u8>| {
        if !deflate {
            return (kind as u8, raw);
        }
        let mut out = Vec::new();
        codec::put_varint(&mut out, raw.len() as u64);
        let mut e = flate2::write::DeflateEncoder::new(out, flate2::Compression::fast());
        std::io::Write::write_all(&mut e, &raw).unwrap();
        (kind as u8 | COMPRESSED, e.finish().unwrap())
    };
    let stats = serde_json::to_vec(&Stats { events: events.len() as u64, ..Default::default() }).unwrap();
    assemble(
        version,
        &[
            (ChunkKind::Meta as u8, serde_json::to_vec(&meta()).unwrap()),
            pack(ChunkKind::Stacks, stack_bytes),
            pack(ChunkKind::Events, enc.payload()),
            (ChunkKind::Stats as u8, stats),
            (ChunkKind::End as u8, Vec::new()),
        ],
    )
}

#[test]
fn version_2_and_3_recordings_are_still_read() {
    let mut events = many_events();
    events.extend(sample_events().into_iter().map(|mut e| {
        match &mut e {
            Event::Alloc(a) => a.ts_ns += 1_000_000,
            Event::Free(f) => f.ts_ns += 1_000_000,
            Event::Task(t) => t.ts_ns += 1_000_000,
        }
        e
    }));
    let stacks = sample_stacks();
    for (version, deflate) in [(2, false), (3, false), (3, true)] {
        let rec = read_all(&older_recording(version, &events, &stacks, deflate)[..]).unwrap();
        assert!(rec.warnings.is_empty(), "{version}: {:?}", rec.warnings);
        assert!(rec.finalized);
        assert_eq!(rec.events, events, "version {version}");
        assert_eq!(rec.stacks.values().cloned().collect::<Vec<_>>(), stacks, "version {version}");
    }
}

#[test]
fn stacks_round_trip_through_the_tree_of_frames() {
    let stacks = sample_stacks();
    let mut w = Writer::new(Vec::new(), &meta()).unwrap();
    for (i, s) in stacks.iter().enumerate() {
        w.stack(s);
        if i == 20 {
            // A new chunk starts a new tree.
            w.flush().unwrap();
        }
    }
    let bytes = w.finish(&Stats::default()).unwrap();
    let rec = read_all(&bytes[..]).unwrap();
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.stacks.values().cloned().collect::<Vec<_>>(), stacks);
    let chunks = stored_chunks(&bytes);
    assert_eq!(chunks.iter().filter(|c| c.0 & !COMPRESSED == ChunkKind::Stacks as u8).count(), 2);
}

/// A chunk's tree of frames is bounded: stacks whose new frames would grow it past
/// `STACK_CHUNK_NODES` go into the next chunk, and every stack reads back whole.
#[test]
fn a_chunks_tree_of_frames_is_cut_at_its_bound() {
    let frames = 100u64;
    // Two chunks of 1,146 stacks and one of 1 (cut after the crossing stack, it was two
    // of 1,147 and 1,146).
    let count = 2 * (u64::from(super::writer::STACK_CHUNK_NODES) / frames) + 1;
    let mut w = Writer::new(Vec::new(), &meta()).unwrap();
    let mut stacks = Vec::new();
    for id in 0..count {
        // No frame shared: each stack adds `frames` nodes.
        let user = (0..frames).map(|f| FileFrame::Module { module: 1, offset: (id * frames + f) * 16 }).collect();
        let s = FileStack { id: id as u32, pid: 7, kernel: vec![], user, truncated: false };
        w.stack(&s);
        stacks.push(s);
    }
    let bytes = w.finish(&Stats::default()).unwrap();
    let rec = read_all(&bytes[..]).unwrap();
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.stacks.values().cloned().collect::<Vec<_>>(), stacks);
    let chunks = stored_chunks(&bytes);
    assert_eq!(chunks.iter().filter(|c| c.0 & !COMPRESSED == ChunkKind::Stacks as u8).count(), 3);
}

/// A recording's end lets the encoders' buffers go after its last event and stack; what
/// still comes after (a late definition, more events) is written into new ones whole.
#[test]
fn what_comes_after_the_encoders_let_go_is_written_whole() {
    let stacks = sample_stacks();
    let events = many_events();
    let (half, rest) = events.split_at(events.len() / 2);
    let mut w = Writer::new(Vec::new(), &meta()).unwrap();
    for s in &stacks[..20] {
        w.stack(s);
    }
    for e in half {
        w.event(e).unwrap();
    }
    w.flush_last().unwrap();
    for s in &stacks[20..] {
        w.stack(s);
    }
    for e in rest {
        w.event(e).unwrap();
    }
    let bytes = w.finish(&Stats::default()).unwrap();
    let rec = read_all(&bytes[..]).unwrap();
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.stacks.values().cloned().collect::<Vec<_>>(), stacks);
    assert_eq!(rec.events, events);
}

#[test]
fn deep_stacks_sharing_their_callers_cost_their_own_frames_only() {
    // 2,000 stacks of 100 frames under one caller chain, each with two frames of its own.
    let callers: Vec<FileFrame> =
        (0..98).map(|i| FileFrame::Module { module: 2, offset: 0x40_0000 + i * 0x1234 }).collect();
    let mut tree = super::stacks::StackEncoder::default();
    let mut flat = Vec::new();
    for id in 0..2_000u32 {
        let mut user = vec![
            FileFrame::Module { module: 1, offset: 0x9000 + u64::from(id) * 24 },
            FileFrame::Module { module: 2, offset: 0x40_0000 + u64::from(id % 50) * 0x80 },
        ];
        user.extend(&callers);
        let s = FileStack { id, pid: 42, kernel: vec![], user, truncated: false };
        tree.push(&s);
        super::stacks::encode_flat(&mut flat, &s);
    }
    let tree = tree.take().bytes;
    assert!(tree.len() * 40 < flat.len(), "tree {} bytes, flat {}", tree.len(), flat.len());
    let parsed = super::stacks::parse_columns(&tree, 0).unwrap();
    assert_eq!(parsed.len(), 2_000);
    assert_eq!(parsed[1_999].user.len(), 100);
    assert_eq!(parsed[1_999].user[2..], callers[..]);
}

#[test]
fn a_hostile_stack_tree_is_corrupt_not_slow() {
    use codec::put_varint;
    let stack = |out: &mut Vec<u8>, node: u64, frames: u64| {
        for v in [1, 42, 0, node, frames] {
            put_varint(out, v);
        }
        for i in 0..frames {
            put_varint(out, 2);
            put_varint(out, i);
        }
    };
    let mut out_of_range = Vec::new();
    stack(&mut out_of_range, 5, 1);
    assert!(super::stacks::parse_tree(&out_of_range, 0).is_err());
    // A chain deeper than any walk.
    let mut deep = Vec::new();
    stack(&mut deep, 0, 5_000);
    assert!(super::stacks::parse_tree(&deep, 0).is_err());
    // A count of frames beyond the chunk.
    let mut short = Vec::new();
    stack(&mut short, 0, 3);
    short.truncate(short.len() - 2);
    assert!(super::stacks::parse_tree(&short, 0).is_err());
}

#[test]
fn timestamps_are_kept_to_the_recordings_resolution() {
    let meta = Meta { time_resolution_ns: 1_000, ..meta() };
    let events = vec![
        alloc(5_000_500, Kind::Malloc, 0x5555_0000_1000, 24),
        alloc(5_000_900, Kind::Malloc, 0x5555_0000_2000, 24),
        free(5_001_999, Kind::Free, 0x5555_0000_1000),
        alloc(5_002_000, Kind::Kmalloc, 0xffff_8880_0000_1000, 64),
        // Out of order by less than the resolution: the file's order is kept.
        free(5_001_500, Kind::Free, 0x5555_0000_2000),
        alloc(9_000_000_123, Kind::Calloc, 0x5555_0000_3000, 8),
    ];
    let mut w = Writer::new(Vec::new(), &meta).unwrap();
    for e in &events {
        w.event(e).unwrap();
    }
    let rec = read_all(&w.finish(&Stats::default()).unwrap()[..]).unwrap();
    assert_eq!(rec.meta.time_resolution_ns, 1_000);
    let times: Vec<u64> = rec.events.iter().map(Event::ts_ns).collect();
    // Counted from the chunk's first event, rounded down.
    assert_eq!(times, [5_000_500, 5_000_500, 5_001_500, 5_001_500, 5_001_500, 8_999_999_500]);
    for (got, want) in rec.events.iter().zip(&events) {
        match (got, want) {
            (Event::Alloc(g), Event::Alloc(w)) => assert_eq!(Alloc { ts_ns: w.ts_ns, ..*g }, *w),
            (Event::Free(g), Event::Free(w)) => assert_eq!(Free { ts_ns: w.ts_ns, ..*g }, *w),
            _ => panic!("{got:?} for {want:?}"),
        }
    }
}

#[test]
fn an_events_chunk_with_a_bad_header_is_corrupt() {
    let bytes = write(&many_events(), true);
    let chunks = stored_chunks(&bytes);
    let (kind, stored) = chunks.iter().find(|c| c.0 & !COMPRESSED == ChunkKind::Events as u8).unwrap().clone();
    let mut raw = if kind & COMPRESSED != 0 {
        let mut c = codec::Cursor::new(&stored, 0);
        c.varint().unwrap();
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::DeflateDecoder::new(c.rest()), &mut raw).unwrap();
        raw
    } else {
        stored
    };
    let mut zero_resolution = raw.clone();
    zero_resolution[12] = 0;
    let mut more_events = raw.clone();
    more_events[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    raw.push(0);
    for (what, payload) in [("resolution", zero_resolution), ("count", more_events), ("trailing", raw)] {
        let rec = read_all(&assemble(VERSION, &[chunks[0].clone(), (ChunkKind::Events as u8, payload)])[..]).unwrap();
        assert!(rec.events.is_empty(), "{what}");
        assert!(rec.warnings.iter().any(|w| w.contains("corrupt")), "{what}: {:?}", rec.warnings);
    }
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

/// Events whose addresses come from a few blocks of each space, so frees name live blocks
/// and allocations reuse freed addresses (the references of format version 5), and whose
/// sizes come from a few (version 7 names a freed block of the allocation's size).
fn arb_pooled_event() -> impl Strategy<Value = Event> {
    (arb_event(), 0u64..12, 0u64..4).prop_map(|(mut e, slot, size)| {
        match &mut e {
            Event::Alloc(a) => {
                a.ptr = 0x5555_0000_1000 + slot * 48 + if a.kind.is_kernel() { 1 << 47 } else { 0 };
                if size > 0 {
                    a.bytes_req = 8 << size;
                    a.bytes_alloc = a.bytes_req + 8 * (size % 2);
                }
            }
            Event::Free(f) => f.ptr = 0x5555_0000_1000 + slot * 48 + if f.kind.is_kernel() { 1 << 47 } else { 0 },
            Event::Task(_) => {}
        }
        e
    })
}

fn arb_stack() -> impl Strategy<Value = FileStack> {
    let frame = prop_oneof![
        (0u32..3, 0u64..6).prop_map(|(module, offset)| FileFrame::Module { module, offset: 0x1000 + offset * 0x40 }),
        (0u64..3).prop_map(|a| FileFrame::Address(0x7f00_0000_0000 + a)),
    ];
    (
        any::<u32>(),
        0u32..3,
        prop::collection::vec(frame, 0..12),
        prop::collection::vec((0u64..4).prop_map(|a| 0xffff_ffff_8100_0000 + a * 16), 0..4),
        any::<bool>(),
    )
        .prop_map(|(id, pid, mut user, kernel, truncated)| {
            // Stacks share callers: the outer frames come from a short list.
            user.extend([FileFrame::Module { module: 0, offset: 0x40 }, FileFrame::Module { module: 0, offset: 0x10 }]);
            FileStack { id, pid, kernel, user, truncated }
        })
}

fn arb_symbol() -> impl Strategy<Value = (SymbolKey, Vec<Symbol>)> {
    let key = prop_oneof![
        any::<u64>().prop_map(SymbolKey::Kernel),
        (0u32..4, any::<u64>()).prop_map(|(module, offset)| SymbolKey::User(FileFrame::Module { module, offset })),
        any::<u64>().prop_map(|a| SymbolKey::User(FileFrame::Address(a))),
    ];
    let entry =
        (0usize..5, prop::option::of(0usize..3), any::<u32>(), any::<bool>()).prop_map(|(n, f, line, inlined)| {
            Symbol { name: format!("fn_{n}").into(), file: f.map(|f| format!("src/{f}.c").into()), line, inlined }
        });
    (key, prop::collection::vec(entry, 0..4))
}

proptest! {
    #[test]
    fn events_naming_earlier_blocks_round_trip(events in prop::collection::vec(arb_pooled_event(), 0..300)) {
        let rec = read_all(&write(&events, true)[..]).unwrap();
        prop_assert_eq!(&rec.events, &events);
        // Each layout with references decodes what it encoded.
        for version in 5..=VERSION {
            let mut enc = events::EventEncoder::with_version(1, version);
            for e in &events {
                enc.push(e);
            }
            let mut decoded = Vec::new();
            events::decode_chunk(&enc.take().bytes, 0, version, &mut |e| decoded.push(e)).unwrap();
            // Slab caches are kept from version 9.
            let expected: Vec<Event> = events
                .iter()
                .map(|e| match e {
                    Event::Alloc(a) if version < 9 => Event::Alloc(Alloc { cache: 0, ..*a }),
                    e => e.clone(),
                })
                .collect();
            prop_assert_eq!(&decoded, &expected, "version {}", version);
        }
    }

    /// Any stacks and symbols, flushed into chunks anywhere, read back as written.
    #[test]
    fn stacks_and_symbols_round_trip(
        stacks in prop::collection::vec(arb_stack(), 0..60),
        symbols in prop::collection::vec(arb_symbol(), 0..40),
        cut in any::<usize>(),
    ) {
        let mut w = Writer::new(Vec::new(), &meta()).unwrap();
        let mut expected_stacks = std::collections::BTreeMap::new();
        for (i, s) in stacks.iter().enumerate() {
            w.stack(s);
            expected_stacks.insert(s.id, s.clone());
            if i == cut % (stacks.len() + 1) {
                w.flush().unwrap();
            }
        }
        let mut expected_symbols = std::collections::BTreeMap::new();
        for (i, (key, syms)) in symbols.iter().enumerate() {
            w.symbol(*key, syms);
            expected_symbols.insert(*key, syms.clone());
            if i == cut % (symbols.len() + 1) {
                w.flush().unwrap();
            }
        }
        let rec = read_all(&w.finish(&Stats::default()).unwrap()[..]).unwrap();
        prop_assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
        prop_assert_eq!(rec.stacks, expected_stacks);
        prop_assert_eq!(rec.symbols, expected_symbols);
    }

    /// The chunk decoders behind the checksum: arbitrary payloads, and mutations of valid
    /// ones, are decoded or refused, never a panic.
    #[test]
    fn chunk_decoders_never_panic(
        noise in prop::collection::vec(any::<u8>(), 0..256),
        events in prop::collection::vec(arb_pooled_event(), 1..50),
        stacks in prop::collection::vec(arb_stack(), 1..20),
        at in any::<usize>(),
        byte in any::<u8>(),
    ) {
        let mut enc = events::EventEncoder::new(1);
        for e in &events {
            enc.push(e);
        }
        let mut payload = enc.take().bytes;
        let mut stack_enc = stacks::StackEncoder::default();
        for s in &stacks {
            stack_enc.push(s);
        }
        let mut stack_payload = stack_enc.take().bytes;
        let mut symbol_enc = symbols::SymbolEncoder::default();
        symbol_enc.push(SymbolKey::Kernel(7), &[Symbol { name: "f".into(), file: Some("a.c".into()), line: 3, inlined: false }]);
        let mut symbol_payload = symbol_enc.take().bytes;
        for p in [&mut payload, &mut stack_payload, &mut symbol_payload] {
            let i = at % p.len();
            p[i] = byte;
        }
        for p in [&noise, &payload] {
            let _ = events::decode_chunk(p, 0, VERSION, &mut |_| {});
        }
        for p in [&noise, &stack_payload] {
            let _ = stacks::parse_columns(p, 0);
        }
        for p in [&noise, &symbol_payload] {
            let _ = symbols::parse_columns(p, 0);
        }
    }
}

/// One `Events` chunk of `events` in the layout of `enc`.
fn encode_chunk(mut enc: events::EventEncoder, events: &[Event]) -> Vec<u8> {
    for e in events {
        enc.push(e);
    }
    enc.take().bytes
}

/// The bytes of `b` deflated as the writer does (level 6 here: the ratios between layouts
/// are what the tests compare).
fn deflated_len(b: &[u8]) -> usize {
    let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::new(6));
    std::io::Write::write_all(&mut e, b).unwrap();
    e.finish().unwrap().len()
}

#[test]
fn addresses_named_by_reference_cost_less_than_deltas() {
    // A heap's life: blocks freed young, in reverse order of birth, their addresses handed
    // out again; a free of a block born in an earlier chunk; one address allocated twice.
    let mut events = Vec::new();
    let mut ts = 1_000;
    let mut seed = 7u64;
    let mut blocks = [0u64; 4];
    for round in 0..2_000u64 {
        // Every other round takes blocks anywhere in the heap; the others get back the
        // blocks the round before freed, the last freed first (as glibc's tcache does).
        if round % 2 == 0 {
            for b in &mut blocks {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                *b = 0x5555_0000_0000 + (seed >> 40) * 0x40;
            }
        } else {
            blocks.reverse();
        }
        for &b in &blocks {
            ts += 10;
            events.push(alloc(ts, Kind::Malloc, b, 56));
        }
        for &b in blocks.iter().rev() {
            ts += 10;
            events.push(free(ts, Kind::Free, b));
        }
    }
    events.push(alloc(ts + 10, Kind::Malloc, 0x6000, 8));
    events.push(alloc(ts + 20, Kind::Malloc, 0x6000, 8));
    events.push(free(ts + 30, Kind::Free, 0x6000));
    events.push(free(ts + 40, Kind::Free, 0x5555_0000_0000));
    let encode = |enc| encode_chunk(enc, &events);
    let (v5, v4) = (encode(events::EventEncoder::new(1)), encode(events::EventEncoder::with_version(1, 4)));
    let mut decoded = Vec::new();
    events::decode_chunk(&v5, 0, VERSION, &mut |e| decoded.push(e)).unwrap();
    assert_eq!(decoded, events);
    decoded.clear();
    events::decode_chunk(&v4, 0, 4, &mut |e| decoded.push(e)).unwrap();
    assert_eq!(decoded, events);
    assert!(
        deflated_len(&v5) * 3 < deflated_len(&v4) * 2,
        "version 5 {} bytes, version 4 {}",
        deflated_len(&v5),
        deflated_len(&v4)
    );
}

#[test]
fn allocations_name_freed_blocks_of_their_size_and_frees_follow_allocation_order() {
    // An interpreter's life: each round builds a list of objects, each with a buffer of a
    // size of its own, then frees them in the order they were made. The allocator keeps a
    // last-in-first-out list of freed blocks per size (glibc's tcache) and carves fresh
    // blocks from the top of the heap when that list is empty.
    let mut events = Vec::new();
    let mut ts = 1_000u64;
    let mut seed = 3u64;
    let mut top = 0x5555_0000_0000u64;
    let mut free_lists: std::collections::HashMap<u64, Vec<u64>> = Default::default();
    for _ in 0..600 {
        let mut made = Vec::new();
        for _ in 0..8 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            for size in [48, 64 << (seed >> 62)] {
                let ptr = free_lists.entry(size).or_default().pop().unwrap_or_else(|| {
                    top += size + 16;
                    top - size
                });
                ts += 10;
                events.push(alloc(ts, Kind::Malloc, ptr, size));
                made.push((ptr, size));
            }
        }
        for (ptr, size) in made {
            ts += 10;
            events.push(free(ts, Kind::Free, ptr));
            free_lists.entry(size).or_default().push(ptr);
        }
    }
    let encode = |enc| encode_chunk(enc, &events);
    let (v7, v6) = (encode(events::EventEncoder::with_version(1, 7)), encode(events::EventEncoder::with_version(1, 6)));
    for (bytes, version) in [(&v7, 7), (&v6, 6)] {
        let mut decoded = Vec::new();
        events::decode_chunk(bytes, 0, version, &mut |e| decoded.push(e)).unwrap();
        assert_eq!(decoded, events, "version {version}");
    }
    // 2.9 KB against 7.5 KB when written.
    assert!(
        deflated_len(&v7) * 2 < deflated_len(&v6),
        "version 7 {} bytes, version 6 {}",
        deflated_len(&v7),
        deflated_len(&v6)
    );
}

#[test]
fn version_8_codes_flags_once_and_times_and_addresses_by_context() {
    // A compiler's life on one thread: allocations of a few sizes, each with the same flags
    // and allocator; most blocks freed soon, some later; a block of a size freed last handed
    // out first, else one from a bin elsewhere or the heap's top. Frees come a microsecond or
    // two after the allocation before them, allocations three to six after a free.
    let mut events = Vec::new();
    let mut ts = 1_000_000u64;
    let mut seed = 5u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        seed >> 33
    };
    let mut top = 0x5555_0000_0000u64;
    let mut free_lists: std::collections::HashMap<u64, Vec<u64>> = Default::default();
    let mut live: Vec<(u64, u64)> = Vec::new();
    for _ in 0..6_000 {
        let size = [24, 40, 56, 104, 200][next() as usize % 5];
        let ptr = match free_lists.entry(size).or_default().pop() {
            Some(p) if next() % 4 != 0 => p,
            _ if next() % 3 == 0 => 0x5555_8000_0000 + (next() % 50_000) * 16,
            _ => {
                top += size + 16;
                top - size
            }
        };
        ts += 3_000 + 1_000 * (next() % 4);
        let mut e = alloc(ts, Kind::Malloc, ptr, size);
        if let Event::Alloc(a) = &mut e {
            a.flags = flags::USABLE_EXACT | flags::HAS_STACK;
            a.allocator = 1;
            a.stack = next() % 40;
        }
        events.push(e);
        live.push((ptr, size));
        while live.len() > 3 || (!live.is_empty() && next() % 3 == 0) {
            let i = if next() % 4 == 0 { live.len() - 1 } else { (next() as usize) % live.len() };
            let (ptr, size) = live.remove(i);
            ts += 1_000 + 1_000 * (next() % 2);
            events.push(free(ts, Kind::Free, ptr));
            free_lists.entry(size).or_default().push(ptr);
        }
    }
    let encode = |enc| encode_chunk(enc, &events);
    let (v8, v7) = (encode(events::EventEncoder::new(1_000)), encode(events::EventEncoder::with_version(1_000, 7)));
    let decode = |bytes: &[u8], version| {
        let mut decoded = Vec::new();
        events::decode_chunk(bytes, 0, version, &mut |e| decoded.push(e)).unwrap();
        decoded
    };
    assert_eq!(decode(&v8, VERSION), events);
    assert_eq!(decode(&v7, 7), events);
    // The same bytes read as the other layout are not these events.
    assert!(events::decode_chunk(&v8, 0, 7, &mut |_| {}).is_err() || decode(&v8, 7) != events);
    let (v8_len, v7_len) = (deflated_len(&v8), deflated_len(&v7));
    assert!(v8_len * 10 < v7_len * 9, "version 8 {v8_len} bytes, version 7 {v7_len}");
}

#[test]
fn version_8_names_blocks_freed_long_ago() {
    // An allocator's bins: 2,000 blocks freed, then handed out again in another order and
    // for another size (a freed block split), long after the last 64 frees.
    let mut events = Vec::new();
    let mut ts = 1_000u64;
    let base = 0x5555_0000_0000u64;
    for i in 0..2_000u64 {
        ts += 10;
        events.push(alloc(ts, Kind::Malloc, base + i * 48, 40));
    }
    for i in 0..2_000u64 {
        ts += 10;
        events.push(free(ts, Kind::Free, base + i * 48));
    }
    let mut seed = 17u64;
    let mut order: Vec<u64> = (0..2_000).collect();
    for i in (1..order.len()).rev() {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        order.swap(i, (seed >> 33) as usize % (i + 1));
    }
    for i in order {
        ts += 10;
        events.push(alloc(ts, Kind::Malloc, base + i * 48, 24));
    }
    let encode = |enc| encode_chunk(enc, &events);
    let (v8, v7) = (encode(events::EventEncoder::new(1)), encode(events::EventEncoder::with_version(1, 7)));
    for (bytes, version) in [(&v8, VERSION), (&v7, 7)] {
        let mut decoded = Vec::new();
        events::decode_chunk(bytes, 0, version, &mut |e| decoded.push(e)).unwrap();
        assert_eq!(decoded, events, "version {version}");
    }
    let (v8_len, v7_len) = (deflated_len(&v8), deflated_len(&v7));
    assert!(v8_len * 10 < v7_len * 8, "version 8 {v8_len} bytes, version 7 {v7_len}");
}

#[test]
fn page_addresses_are_coded_by_page_not_by_byte() {
    // The page allocator's events carry `struct page` pointers, 64 bytes apart per page.
    // Faults take runs of four pages from anywhere in memory (as the heavy Python bench's
    // page-cache and anonymous faults do), now and then an order-2 block; every other page
    // is freed in bursts; and one pointer is off that stride (it must still round-trip).
    let vmemmap = 0xffff_ea00_0000_0000u64;
    let mut events = Vec::new();
    let mut ts = 1_000;
    let mut seed = 11u64;
    for _ in 0..500 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut next = vmemmap + (seed >> 42) * 4 * 64;
        let mut taken = Vec::new();
        for i in 0..4u64 {
            let order = if seed.is_multiple_of(8) && i == 3 { 2 } else { 0 };
            ts += 10;
            let mut e = alloc(ts, Kind::PageAlloc, next, 4096 << order);
            if let Event::Alloc(a) = &mut e {
                a.bytes_alloc = 4096 << order;
                a.order = order as u8;
            }
            events.push(e);
            taken.push(next);
            next += 64 << order;
        }
        for p in taken.into_iter().step_by(2) {
            ts += 10;
            events.push(free(ts, Kind::PageFree, p));
        }
    }
    events.push(alloc(ts + 10, Kind::PageAlloc, vmemmap + 3, 4096));
    events.push(free(ts + 20, Kind::PageFree, vmemmap + 3));
    let encode = |enc| encode_chunk(enc, &events);
    let (v6, v5) = (encode(events::EventEncoder::with_version(1, 6)), encode(events::EventEncoder::with_version(1, 5)));
    for (bytes, version) in [(&v6, 6), (&v5, 5)] {
        let mut decoded = Vec::new();
        events::decode_chunk(bytes, 0, version, &mut |e| decoded.push(e)).unwrap();
        assert_eq!(decoded, events, "version {version}");
    }
    // A jump across memory takes a byte less counted in pages (on the bench: 4 % of the
    // address stream).
    assert!(v6.len() + 500 <= v5.len(), "version 6 {} bytes, version 5 {}", v6.len(), v5.len());
    assert!(
        deflated_len(&v6) < deflated_len(&v5),
        "version 6 {} bytes, version 5 {}",
        deflated_len(&v6),
        deflated_len(&v5)
    );
}

#[test]
fn stack_ids_are_coded_per_task_as_deltas() {
    // Two threads of an interpreter each walk through new code: their allocations' stacks
    // are new ones, numbered as first seen, interleaved between the threads, with repeats.
    let mut events = Vec::new();
    let mut next_id = 100u64;
    let mut ids = [Vec::new(), Vec::new()];
    let mut seed = 5u64;
    for i in 0..4_000u64 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let thread = (seed >> 60) as usize % 2;
        let stack = if seed.is_multiple_of(4) && !ids[thread].is_empty() {
            *ids[thread].last().unwrap()
        } else {
            next_id += 1;
            ids[thread].push(next_id);
            next_id
        };
        let mut e = alloc(1_000 + i * 10, Kind::Malloc, 0x5555_0000_0000 + i * 64, 48);
        if let Event::Alloc(a) = &mut e {
            a.tid = 43 + thread as u32;
            a.stack = stack;
        }
        events.push(e);
    }
    let encode = |enc| encode_chunk(enc, &events);
    let (v6, v5) = (encode(events::EventEncoder::with_version(1, 6)), encode(events::EventEncoder::with_version(1, 5)));
    for (bytes, version) in [(&v6, 6), (&v5, 5)] {
        let mut decoded = Vec::new();
        events::decode_chunk(bytes, 0, version, &mut |e| decoded.push(e)).unwrap();
        assert_eq!(decoded, events, "version {version}");
    }
    // Two bytes an id in version 5; about one, and a run of like ones, in version 6.
    assert!(v6.len() + 3_500 <= v5.len(), "version 6 {} bytes, version 5 {}", v6.len(), v5.len());
}

#[test]
fn version_4_recordings_are_still_read() {
    let events = many_events();
    let stacks = sample_stacks();
    let key = SymbolKey::User(FileFrame::Module { module: 0, offset: 0x1234 });
    let syms = [Symbol { name: "main".into(), file: Some("main.c".into()), line: 4, inlined: false }];
    let mut enc = events::EventEncoder::with_version(1, 4);
    for e in &events {
        enc.push(e);
    }
    let mut symbol_bytes = Vec::new();
    symbols::encode_rows(&mut symbol_bytes, key, &syms);
    let bytes = assemble(
        4,
        &[
            (ChunkKind::Meta as u8, serde_json::to_vec(&meta()).unwrap()),
            (ChunkKind::Stacks as u8, stacks::encode_tree_rows(&stacks)),
            (ChunkKind::Symbols as u8, symbol_bytes),
            (ChunkKind::Events as u8, enc.take().bytes),
            (ChunkKind::End as u8, Vec::new()),
        ],
    );
    let rec = read_all(&bytes[..]).unwrap();
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
    assert_eq!(rec.events, events);
    assert_eq!(rec.stacks.values().cloned().collect::<Vec<_>>(), stacks);
    assert_eq!(rec.symbols[&key], syms);
}

#[test]
fn references_to_blocks_and_frames_that_do_not_exist_are_corrupt() {
    use codec::put_varint;
    // An events chunk of one free naming the newest live block, with none live.
    let mut enc = events::EventEncoder::new(1);
    enc.push(&free(10, Kind::Free, 0x1000));
    let good = enc.take().bytes;
    let mut bad = good.clone();
    // The address stream holds "0, delta"; make it "1" (a block by rank) and a pad byte.
    let addr = good.len() - 4;
    assert_eq!(good[addr], 0, "{good:?}");
    bad[addr] = 1;
    assert!(events::decode_chunk(&bad, 0, VERSION, &mut |_| {}).is_err());
    // A stack sharing more frames than the previous one has, and a node not made yet.
    for reference in [2 * 3 + 1, 2 * 5] {
        let mut payload = Vec::new();
        let (head, shared, counts) = ([0u8, 42, 0], [reference as u8], [0u8]);
        for len in [head.len(), shared.len(), counts.len(), 0, 0, 0, 0] {
            put_varint(&mut payload, len as u64);
        }
        payload.extend(head);
        payload.extend(shared);
        payload.extend(counts);
        assert!(stacks::parse_columns(&payload, 0).is_err(), "{reference}");
    }
}

/// A disk that takes `room` bytes, then fails every write as a full one does.
struct SmallDisk {
    bytes: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    room: usize,
}

impl std::io::Write for SmallDisk {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut bytes = self.bytes.lock().unwrap();
        let n = buf.len().min(self.room - bytes.len());
        if n == 0 && !buf.is_empty() {
            return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        }
        bytes.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes `events` as the recorder does (a flush now and then, the pending ones, the
/// end) until a write fails; the events counted as flushed before it, if one did.
fn write_until_full<W: std::io::Write + Send + 'static>(mut w: Writer<W>, events: &[Event]) -> Option<u64> {
    for (i, e) in events.iter().enumerate() {
        if w.event(e).is_err() || (i % 3_000 == 2_999 && w.flush().is_err()) {
            return Some(w.events_flushed());
        }
    }
    if w.flush().is_err() {
        return Some(w.events_flushed());
    }
    let kept = w.events_flushed();
    assert_eq!(kept, events.len() as u64, "all flushed");
    w.finish(&Stats::default()).err().map(|_| kept)
}

#[test]
fn a_full_disk_keeps_at_least_the_events_counted_as_flushed() {
    let events = many_events();
    let whole = {
        let bytes = std::sync::Arc::default();
        let disk = SmallDisk { bytes: std::sync::Arc::clone(&bytes), room: usize::MAX };
        assert_eq!(write_until_full(Writer::new(disk, &meta()).unwrap(), &events), None);
        bytes.lock().unwrap().len()
    };
    let mut counted = Vec::new();
    for room in (300..whole).step_by(whole / 41) {
        let bytes = std::sync::Arc::default();
        let disk = SmallDisk { bytes: std::sync::Arc::clone(&bytes), room };
        let Ok(w) = Writer::new(std::io::BufWriter::with_capacity(4096, disk), &meta()) else { continue };
        let kept = write_until_full(w, &events).expect("a disk too small for the recording fails a write");
        let rec = read_all(&bytes.lock().unwrap()[..]).unwrap();
        assert!(rec.events.len() as u64 >= kept, "{room}: read {} of {kept}", rec.events.len());
        assert!(events.starts_with(&rec.events));
        assert!(!rec.finalized);
        counted.push(kept);
    }
    // The count grows with the room, and is not always zero.
    assert!(counted.windows(2).all(|w| w[0] <= w[1]) && counted.last() > Some(&0), "{counted:?}");
}

/// A definitions chunk whose checksum holds but whose content does not parse: the report
/// reads the definitions before it and the events before it, not those after it (the
/// events pass skips definitions without parsing them again, so it stops where the
/// definitions pass met the damage).
#[test]
fn events_after_damaged_definitions_are_not_read() {
    let events = many_events();
    let (first, second) = events.split_at(events.len() / 2);
    let chunk_of = |events: &[Event]| {
        let mut enc = events::EventEncoder::new(1);
        events.iter().for_each(|e| enc.push(e));
        (ChunkKind::Events as u8, enc.take().bytes)
    };
    let meta_chunk = stored_chunks(&write(&[], false))[0].clone();
    let bad_stacks = (ChunkKind::Stacks as u8, vec![0xff; 40]);
    let file = assemble(VERSION, &[meta_chunk, chunk_of(first), bad_stacks, chunk_of(second)]);
    let tmp = tempfile::Builder::new().prefix("memtrace-damaged-defs-").tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let path = dir.join("damaged.data");
    std::fs::write(&path, &file).unwrap();
    let defs = crate::report::load::read_definitions(&path).unwrap();
    assert!(defs.damaged_at.is_some(), "{:?}", defs.warnings);
    let mut read = 0;
    crate::report::load::for_each_event(&path, defs.damaged_at, &mut |_| read += 1).unwrap();
    assert_eq!(read, first.len());
    // Without the limit (dump without stacks reads no definitions) every event is read.
    let mut all = 0;
    crate::report::load::for_each_event(&path, None, &mut |_| all += 1).unwrap();
    assert_eq!(all, events.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An output that notes the thread of each write.
struct ThreadNoting {
    bytes: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    threads: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

impl std::io::Write for ThreadNoting {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let name = std::thread::current().name().unwrap_or("").to_string();
        self.threads.lock().unwrap().insert(name);
        self.bytes.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything after the header is encoded, deflated and written on the writer thread; a
/// `flush` returns once what it was handed is in the output (the warnings pass reads the
/// file then), and a `flush_behind` without waiting writes the same file in the end.
#[test]
fn the_writer_thread_writes_in_order_and_flush_waits_for_it() {
    let events = many_events();
    let (half, rest) = events.split_at(events.len() / 2);
    let bytes = std::sync::Arc::default();
    let threads = std::sync::Arc::default();
    let out = ThreadNoting { bytes: std::sync::Arc::clone(&bytes), threads: std::sync::Arc::clone(&threads) };
    let mut w = Writer::new(out, &meta()).unwrap();
    half.iter().for_each(|e| w.event(e).unwrap());
    w.flush().unwrap();
    let at_flush = read_all(&bytes.lock().unwrap()[..]).unwrap();
    assert_eq!(at_flush.events, half, "a flush returns with its events in the output");
    assert_eq!(w.events_flushed(), half.len() as u64);
    rest.iter().for_each(|e| w.event(e).unwrap());
    w.flush_behind().unwrap();
    w.finish(&Stats::default()).unwrap();
    let whole = read_all(&bytes.lock().unwrap()[..]).unwrap();
    assert!(whole.finalized);
    assert_eq!(whole.events, events);
    let threads = threads.lock().unwrap();
    assert!(threads.contains("memtrace-writer"), "{threads:?}");
    // The header and the `Meta` chunk are written by `new`, on the caller's thread.
    assert_eq!(threads.len(), 2, "{threads:?}");
}
