//! The userspace pipeline alone, on a synthetic stream of ring records: decoding, pairing
//! and aggregation (what `report` and `top` do per event), and the recording path
//! (decoding, time ordering, encoding into the file format). `cargo xtask bench` reports
//! the events-per-second figures.
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use memtrace::{
    analysis::{Analyzer, Origin},
    event::{Record, decode},
    recording::{Meta, Writer},
    session::reorder::Reorder,
};
use memtrace_common::{FreeRecord, Kind, RecordType, UserAllocRecord, flags};

const EVENTS: usize = 1_000_000;

fn bytes_of<T: Copy>(value: &T) -> Vec<u8> {
    // SAFETY: the records are padding-free plain data.
    unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

/// malloc/free pairs from 8 threads and 64 stacks, each block freed a few events later,
/// as one CPU's ring would hold them.
fn stream() -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(EVENTS);
    let mut ts = 1_000_000u64;
    let mut live: Vec<(u64, u32)> = Vec::new();
    let mut i = 0u64;
    while out.len() < EVENTS {
        ts += 37;
        let tid = 100 + (i % 8) as u32;
        if live.len() < 16 || i.is_multiple_of(2) {
            let ptr = 0x5555_0000_0000 + (i % 4096) * 64 + (i / 4096 % 7) * 0x40_0000;
            let size = 16 + (i % 13) * 8;
            out.push(bytes_of(&UserAllocRecord {
                rtype: RecordType::UserAlloc as u8,
                kind: Kind::Malloc as u8,
                flags: flags::HAS_STACK | flags::USABLE_EXACT,
                allocator: 0,
                pid: 100,
                tid,
                bytes_extra: 8,
                ts_ns: ts,
                ptr,
                bytes_req: size,
                stack: 1 + (i % 64),
            }));
            live.push((ptr, tid));
        } else {
            let (ptr, tid) = live.remove(0);
            out.push(bytes_of(&FreeRecord {
                rtype: RecordType::Free as u8,
                kind: Kind::Free as u8,
                flags: 0,
                _pad: 0,
                pid: 100,
                tid,
                arg: 0,
                ts_ns: ts,
                ptr,
            }));
        }
        i += 1;
    }
    out
}

fn pipeline(c: &mut Criterion) {
    let records = stream();
    let mut group = c.benchmark_group("pipeline");
    group.throughput(Throughput::Elements(records.len() as u64));
    group.sample_size(10);
    group.bench_function("decode+pair+aggregate", |b| {
        b.iter(|| {
            let mut analyzer = Analyzer::new(|o: &Origin| o.stack as u32);
            for r in &records {
                if let Ok(Record::Event(e)) = decode(r, 0) {
                    analyzer.push(&e);
                }
            }
            analyzer.finish();
            analyzer.events
        })
    });
    group.bench_function("decode+order+encode", |b| {
        b.iter(|| {
            let mut reorder = Reorder::new();
            let mut writer = Writer::new(std::io::sink(), &Meta::default()).unwrap();
            // Released as the recorder does: in batches, all but the last stretch of time.
            for (i, r) in records.iter().enumerate() {
                if let Ok(Record::Event(e)) = decode(r, 0) {
                    let ts = e.ts_ns();
                    reorder.push(e);
                    if i.is_multiple_of(8192) {
                        reorder.release(ts.saturating_sub(100_000), &mut |e| writer.event(&e).unwrap());
                    }
                }
            }
            reorder.release_all(&mut |e| writer.event(&e).unwrap());
            writer.events_written()
        })
    });
    group.finish();
}

criterion_group!(benches, pipeline);
criterion_main!(benches);
