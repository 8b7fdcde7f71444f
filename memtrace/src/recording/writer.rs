//! Writing a recording. Definitions (modules, stacks, symbols) are flushed before the
//! events that follow them; events go out in chunks of bounded size so a crash loses at
//! most the chunk being filled. Chunks that grow with the run are deflated. Encoding,
//! deflating and writing run on a thread of their own (`memtrace-writer`): the thread
//! that drains the rings only hands over batches of what it recorded.
use std::{
    io::{self, Write},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc::{Receiver, SyncSender, sync_channel},
    },
    thread::JoinHandle,
};

use flate2::{Compression, write::DeflateEncoder};

use super::{
    COMPRESSED, ChunkKind, FileFrame, FileStack, HEADER_LEN, MAGIC, Meta, Module, Stats, Symbol, SymbolKey, VERSION,
    chunk_crc,
    codec::{put_bytes, put_str, put_varint},
    events::EventEncoder,
    stacks::StackEncoder,
    symbols::SymbolEncoder,
};
use crate::event::Event;

/// Events chunks are cut at this many bytes (before deflating), if the recorder's periodic
/// flush has not cut them first. A chunk starts its references afresh, so larger ones cost
/// less: on the heavy Python bench 1 MiB takes 3 % off the file where 256 KiB cut it every
/// ~20k events.
const EVENTS_CHUNK_BYTES: usize = 1 << 20;
/// A chunk's stacks share frames through a tree of at most this many nodes before the
/// chunk is cut: the tree's table (and its siblings') is the writer's largest part on deep,
/// varied stacks. PyTorch's chunks grew trees of up to ~450k nodes, 26 MB of tables; at
/// this size the table stays at 2^17 buckets (hashbrown fills 7/8 of them).
pub(super) const STACK_CHUNK_NODES: u32 = 7 << 14;
/// Payloads shorter than this are stored as they are.
const DEFLATE_FROM_BYTES: usize = 256;
/// zlib's level 7: on the heavy Python bench's recording (format 4), level 6 deflated events and
/// stacks to 27 % less than level 1 (1.64 MB against 2.2 MB) for ~60 ms more over the
/// whole run; level 7 takes 1 % more off the heavy bench's file (format 7) and 5 % off the
/// sustained bench's for about the same time; level 8 saves 1 % more than 7 on the heavy
/// bench but doubles the time on the sustained bench's 38 M events (10.5 → 21 s).
const DEFLATE_LEVEL: u32 = 7;

/// `payload` deflated behind its length, when that is smaller. A deflate block ends at each
/// of `ends` (a sync flush), so each stream of a chunk gets Huffman codes of its own: 3 %
/// smaller than letting deflate place its blocks where its buffer fills.
fn deflated(payload: &[u8], ends: &[usize]) -> Option<Vec<u8>> {
    if payload.len() < DEFLATE_FROM_BYTES {
        return None;
    }
    let mut out = Vec::with_capacity(payload.len() / 3);
    put_varint(&mut out, payload.len() as u64);
    let mut encoder = DeflateEncoder::new(out, Compression::new(DEFLATE_LEVEL));
    let mut start = 0;
    for &end in ends.iter().filter(|&&e| e <= payload.len()) {
        encoder.write_all(&payload[start..end]).ok()?;
        encoder.flush().ok()?;
        start = end;
    }
    encoder.write_all(&payload[start..]).ok()?;
    let out = encoder.finish().ok()?;
    (out.len() < payload.len()).then_some(out)
}

/// The writing itself, on the writer thread: the encoders and the output.
struct ChunkWriter<W: Write> {
    out: W,
    events: EventEncoder,
    modules: Vec<u8>,
    stacks: StackEncoder,
    symbols: SymbolEncoder,
    bytes_written: u64,
    events_written: u64,
    /// Events in the chunks handed to `out` so far, and in those `out` took whole (its
    /// last successful flush): what a reader finds if a later write fails.
    events_chunked: u64,
    events_flushed: u64,
}

impl<W: Write> ChunkWriter<W> {
    /// Writes the header and the `Meta` chunk.
    fn new(mut out: W, meta: &Meta) -> io::Result<Self> {
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(MAGIC);
        header[8..10].copy_from_slice(&VERSION.to_le_bytes());
        header[10] = if cfg!(target_endian = "little") { 1 } else { 2 };
        header[11] = size_of::<usize>() as u8;
        header[12] = super::CLOCK_MONOTONIC;
        out.write_all(&header)?;
        let mut writer = Self {
            out,
            events: EventEncoder::new(meta.time_resolution_ns),
            modules: Vec::new(),
            stacks: StackEncoder::default(),
            symbols: SymbolEncoder::default(),
            bytes_written: HEADER_LEN as u64,
            events_written: 0,
            events_chunked: 0,
            events_flushed: 0,
        };
        let json = serde_json::to_vec(meta).map_err(io::Error::other)?;
        writer.chunk(ChunkKind::Meta, &json, &[])?;
        writer.out.flush()?;
        Ok(writer)
    }

    /// Writes a chunk; `ends`: where the streams of its payload end.
    fn chunk(&mut self, kind: ChunkKind, payload: &[u8], ends: &[usize]) -> io::Result<()> {
        let packed = match kind {
            ChunkKind::Events | ChunkKind::Stacks | ChunkKind::Modules | ChunkKind::Symbols => deflated(payload, ends),
            ChunkKind::Meta | ChunkKind::Stats | ChunkKind::End => None,
        };
        let (kind, payload) = match &packed {
            Some(packed) => (kind as u8 | COMPRESSED, packed.as_slice()),
            None => (kind as u8, payload),
        };
        let mut head = [0u8; 9];
        head[0] = kind;
        head[1..5].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        head[5..9].copy_from_slice(&chunk_crc(VERSION, kind, payload.len() as u32, payload).to_le_bytes());
        self.out.write_all(&head)?;
        self.out.write_all(payload)?;
        self.bytes_written += (head.len() + payload.len()) as u64;
        Ok(())
    }

    fn bytes_written(&self) -> u64 {
        self.bytes_written
    }

    /// Lets go of the encoders' buffers when no chunk is being filled.
    fn release(&mut self) {
        self.events.release();
        self.stacks.release();
    }

    /// Events whose chunks reached the output whole: after a failed write, the events a
    /// reader of the file still finds.
    fn events_flushed(&self) -> u64 {
        self.events_flushed
    }

    fn event(&mut self, event: &Event) -> io::Result<()> {
        self.events.push(event);
        self.events_written += 1;
        if self.events.len() >= EVENTS_CHUNK_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn item(&mut self, item: &Item) -> io::Result<()> {
        match item {
            Item::Event(e) => return self.event(e),
            Item::Module(m) => self.module(m),
            Item::Stack(s) => return self.stack(s),
            Item::Symbol(key, symbols) => self.symbol(*key, symbols),
        }
        Ok(())
    }

    fn module(&mut self, m: &Module) {
        put_varint(&mut self.modules, u64::from(m.id));
        put_bytes(&mut self.modules, &m.build_id);
        put_str(&mut self.modules, &m.path);
    }

    fn stack(&mut self, s: &FileStack) -> io::Result<()> {
        // Cut before a stack whose frames could take the tree past its bound (checked
        // after, the stack crossing it grew the table to twice the buckets, kept after).
        let frames = (s.kernel.len() + s.user.len()) as u32;
        let nodes = self.stacks.nodes();
        if nodes > 0 && nodes.saturating_add(frames) > STACK_CHUNK_NODES {
            self.flush()?;
        }
        self.stacks.push(s);
        Ok(())
    }

    fn symbol(&mut self, key: SymbolKey, symbols: &[Symbol]) {
        self.symbols.push(key, symbols);
    }

    /// Writes pending definitions, then pending events, and flushes the output.
    fn flush(&mut self) -> io::Result<()> {
        if !self.modules.is_empty() {
            let modules = std::mem::take(&mut self.modules);
            self.chunk(ChunkKind::Modules, &modules, &[])?;
        }
        for (kind, streams) in [(ChunkKind::Stacks, self.stacks.take()), (ChunkKind::Symbols, self.symbols.take())] {
            if !streams.bytes.is_empty() {
                self.chunk(kind, &streams.bytes, &streams.ends)?;
            }
        }
        if !self.events.is_empty() {
            let streams = self.events.take();
            self.chunk(ChunkKind::Events, &streams.bytes, &streams.ends)?;
            self.events_chunked = self.events_written;
        }
        self.flush_out()
    }

    fn flush_out(&mut self) -> io::Result<()> {
        self.out.flush()?;
        self.events_flushed = self.events_chunked;
        Ok(())
    }

    fn stats(&mut self, stats: &Stats) -> io::Result<()> {
        self.flush()?;
        self.stats_so_far(stats)
    }

    /// A `Stats` chunk between others, on its way to the file at once: the events pending
    /// stay for their own chunk.
    fn stats_so_far(&mut self, stats: &Stats) -> io::Result<()> {
        let json = serde_json::to_vec(stats).map_err(io::Error::other)?;
        self.chunk(ChunkKind::Stats, &json, &[])?;
        self.flush_out()
    }

    /// Writes everything pending and hands back the output, without finalizing.
    fn into_inner(mut self) -> io::Result<W> {
        self.flush()?;
        Ok(self.out)
    }

    /// Writes everything pending, the final stats and the `End` marker.
    fn finish(mut self, stats: &Stats) -> io::Result<W> {
        self.stats(stats)?;
        self.chunk(ChunkKind::End, &[], &[])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Records handed to the writer thread at once, at most.
const BATCH: usize = 4096;
/// Bytes a batch holds, at most (roughly: a stack of 511 frames is ~10 KB, so 4,096 of
/// them would be 40 MB).
const BATCH_BYTES: usize = 1 << 20;
/// Batches on their way to the writer thread: past them, the thread that records waits
/// (the rings then fill and their losses are counted) instead of memory growing.
const BATCHES_IN_FLIGHT: usize = 8;

/// What the recorder hands over, in its order.
enum Item {
    Event(Event),
    Module(Module),
    Stack(FileStack),
    Symbol(SymbolKey, Vec<Symbol>),
}

impl Item {
    /// The bytes it holds, roughly.
    fn bytes(&self) -> usize {
        size_of::<Self>()
            + match self {
                Self::Event(_) => 0,
                Self::Module(m) => m.build_id.len() + m.path.len(),
                Self::Stack(s) => s.kernel.len() * size_of::<u64>() + s.user.len() * size_of::<FileFrame>(),
                Self::Symbol(_, symbols) => symbols
                    .iter()
                    .map(|s| size_of::<Symbol>() + s.name.len() + s.file.as_ref().map_or(0, |f| f.len()))
                    .sum(),
            }
    }
}

enum Job {
    Items(Vec<Item>),
    /// Everything before it to the output, then the output flushed; the result is sent
    /// back when a channel is given.
    Flush(Option<SyncSender<io::Result<()>>>),
    /// The encoders' buffers, grown to the largest chunk and kept for the next, let go:
    /// no more events or stacks are coming (they would still be written, into new ones).
    Release,
    /// Everything before it, then a `Stats` chunk of what is known so far.
    Stats(Box<Stats>),
    Finish(Box<Stats>),
}

/// What the writer thread has done, for the recorder to read at any time.
#[derive(Default)]
struct Progress {
    bytes_written: AtomicU64,
    events_flushed: AtomicU64,
    failed: AtomicBool,
    /// The first write that failed: every later call reports it.
    error: Mutex<Option<(Option<i32>, io::ErrorKind, String)>>,
}

impl Progress {
    fn note(&self, w: &ChunkWriter<impl Write>) {
        self.bytes_written.store(w.bytes_written(), Ordering::Release);
        self.events_flushed.store(w.events_flushed(), Ordering::Release);
    }

    fn fail(&self, e: &io::Error) {
        let mut error = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if error.is_none() {
            *error = Some((e.raw_os_error(), e.kind(), e.to_string()));
        }
        self.failed.store(true, Ordering::Release);
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Ok, or the error of the write that failed.
    fn result(&self) -> io::Result<()> {
        if self.failed() { Err(self.error()) } else { Ok(()) }
    }

    fn error(&self) -> io::Error {
        match &*self.error.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((Some(code), _, _)) => io::Error::from_raw_os_error(*code),
            Some((None, kind, text)) => io::Error::new(*kind, text.clone()),
            None => io::Error::other("the recording's writer stopped"),
        }
    }
}

/// Writes a recording: the header and `Meta` chunk at once, then what it is handed, in
/// order, on the writer thread. A write that fails stops the writing there; the calls
/// after it return its error, and [`Writer::events_flushed`] counts the events the output
/// took whole before it.
pub struct Writer<W: Write + Send + 'static> {
    batch: Vec<Item>,
    /// What `batch` holds, roughly ([`Item::bytes`]).
    batch_bytes: usize,
    jobs: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<io::Result<W>>>,
    progress: Arc<Progress>,
    events_written: u64,
}

impl<W: Write + Send + 'static> Writer<W> {
    /// Writes the header and the `Meta` chunk, and starts the writer thread.
    pub fn new(out: W, meta: &Meta) -> io::Result<Self> {
        let inner = ChunkWriter::new(out, meta)?;
        let progress = Arc::new(Progress::default());
        progress.note(&inner);
        let (jobs, queue) = sync_channel(BATCHES_IN_FLIGHT);
        let shared = Arc::clone(&progress);
        let thread = std::thread::Builder::new()
            .name("memtrace-writer".into())
            .spawn(move || write_jobs(inner, &queue, &shared))?;
        Ok(Self {
            batch: Vec::with_capacity(BATCH),
            batch_bytes: 0,
            jobs: Some(jobs),
            thread: Some(thread),
            progress,
            events_written: 0,
        })
    }

    /// Bytes of the file written so far (those handed over still being written are not).
    pub fn bytes_written(&self) -> u64 {
        self.progress.bytes_written.load(Ordering::Acquire)
    }

    /// Events handed over.
    pub fn events_written(&self) -> u64 {
        self.events_written
    }

    /// Events whose chunks reached the output whole: after a failed write, the events a
    /// reader of the file still finds.
    pub fn events_flushed(&self) -> u64 {
        self.progress.events_flushed.load(Ordering::Acquire)
    }

    fn send(&mut self, job: Job) -> io::Result<()> {
        let sent = self.jobs.as_ref().is_some_and(|jobs| jobs.send(job).is_ok());
        if sent { self.progress.result() } else { Err(self.progress.error()) }
    }

    fn hand_over(&mut self) -> io::Result<()> {
        if self.batch.is_empty() {
            return self.progress.result();
        }
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
        self.batch_bytes = 0;
        self.send(Job::Items(batch))
    }

    fn push(&mut self, item: Item) -> io::Result<()> {
        self.batch_bytes += item.bytes();
        self.batch.push(item);
        if self.batch.len() >= BATCH || self.batch_bytes >= BATCH_BYTES { self.hand_over() } else { Ok(()) }
    }

    pub fn event(&mut self, event: &Event) -> io::Result<()> {
        self.events_written += 1;
        self.push(Item::Event(event.clone()))
    }

    pub fn module(&mut self, m: &Module) {
        let _ = self.push(Item::Module(m.clone()));
    }

    pub fn stack(&mut self, s: &FileStack) {
        let _ = self.push(Item::Stack(s.clone()));
    }

    pub fn symbol(&mut self, key: SymbolKey, symbols: &[Symbol]) {
        let _ = self.push(Item::Symbol(key, symbols.to_vec()));
    }

    /// Hands over what is pending, then a `Stats` chunk of what is known so far, without
    /// waiting: a recording whose end is never written (memtrace killed, the disk full)
    /// still reads what the session knew of its allocators. The last `Stats` chunk of a
    /// file is the one read; the final one comes at [`Writer::finish`].
    pub fn stats_so_far(&mut self, stats: &Stats) -> io::Result<()> {
        self.hand_over()?;
        self.send(Job::Stats(Box::new(stats.clone())))
    }

    /// Hands over what is pending and asks for it to be written and the output flushed,
    /// without waiting; returns the error of a write that failed before.
    pub fn flush_behind(&mut self) -> io::Result<()> {
        self.hand_over()?;
        self.send(Job::Flush(None))
    }

    /// As [`Writer::flush`], then lets go of the buffers the events and stacks encoders
    /// kept for their next chunk: for the end of a recording, after its last event and
    /// stack (on PyTorch the stack tree's table and the events' references held ~28 MB
    /// while the frames were named).
    pub fn flush_last(&mut self) -> io::Result<()> {
        self.flush()?;
        self.send(Job::Release)
    }

    /// Writes pending definitions, then pending events, and flushes the output: returns
    /// once they are written.
    pub fn flush(&mut self) -> io::Result<()> {
        self.hand_over()?;
        let (done, result) = sync_channel(1);
        self.send(Job::Flush(Some(done)))?;
        result.recv().unwrap_or_else(|_| Err(self.progress.error()))
    }

    /// Ends the writer thread after the job given (none: after what was handed over) and
    /// hands back the output.
    fn close(mut self, last: Option<Job>) -> io::Result<W> {
        self.hand_over()?;
        if let Some(job) = last {
            self.send(job)?;
        }
        self.jobs = None;
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            _ => Err(io::Error::other("the recording's writer thread panicked")),
        }
    }

    /// Writes everything pending and hands back the output, without finalizing.
    pub fn into_inner(self) -> io::Result<W> {
        self.close(None)
    }

    /// Writes everything pending, the final stats and the `End` marker.
    pub fn finish(self, stats: &Stats) -> io::Result<W> {
        self.close(Some(Job::Finish(Box::new(stats.clone()))))
    }
}

impl<W: Write + Send + 'static> Drop for Writer<W> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The writer thread: applies the jobs in order until the recorder is done. After a write
/// that failed, what follows is dropped and each flush answered with its error.
fn write_jobs<W: Write>(mut w: ChunkWriter<W>, jobs: &Receiver<Job>, progress: &Progress) -> io::Result<W> {
    // What a job did to the output, for the recorder; a write that failed stops the writing.
    let noted = |result: io::Result<()>, w: &ChunkWriter<W>| {
        progress.note(w);
        if let Err(e) = result {
            progress.fail(&e);
        }
    };
    while let Ok(job) = jobs.recv() {
        let failed = progress.failed();
        match job {
            Job::Items(_) if failed => {}
            Job::Items(items) => {
                let result = items.iter().try_for_each(|item| w.item(item));
                noted(result, &w);
            }
            Job::Flush(done) => {
                if !failed {
                    let result = w.flush();
                    noted(result, &w);
                }
                if let Some(done) = done {
                    let _ = done.send(progress.result());
                }
            }
            Job::Release => w.release(),
            Job::Stats(_) if failed => {}
            Job::Stats(stats) => {
                let result = w.stats_so_far(&stats);
                noted(result, &w);
            }
            Job::Finish(_) if failed => return Err(progress.error()),
            Job::Finish(stats) => return w.finish(&stats).inspect_err(|e| progress.fail(e)),
        }
    }
    progress.result()?;
    w.into_inner().inspect_err(|e| progress.fail(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deep stacks fill a batch by their bytes long before its count: what waits for the
    /// writer thread stays near `BATCH_BYTES` a batch.
    #[test]
    fn a_batch_is_handed_over_at_its_bytes() {
        let mut w = Writer::new(Vec::new(), &Meta::default()).unwrap();
        let deep = FileStack {
            id: 1,
            pid: 1,
            kernel: vec![0xffff_ffff_8100_0000; 255],
            user: vec![FileFrame::Address(0x7f00_0000_0000); 511],
            truncated: false,
        };
        assert!(Item::Stack(deep.clone()).bytes() > 10_000);
        let mut most = 0;
        for _ in 0..1000 {
            w.stack(&deep);
            most = most.max(w.batch_bytes);
            assert!(w.batch.len() < BATCH);
        }
        assert!(most < BATCH_BYTES + 20_000, "{most}");
        assert!(w.batch.len() <= BATCH_BYTES / 10_000 + 1, "{}", w.batch.len());
        let out = w.into_inner().unwrap();
        assert!(out.len() > HEADER_LEN);
    }
}
