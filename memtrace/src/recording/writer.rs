//! Writing a recording. Definitions (modules, stacks, symbols) are flushed before the
//! events that follow them; events go out in chunks of bounded size so a crash loses at
//! most the chunk being filled. Chunks that grow with the run are deflated.
use std::io::{self, Write};

use flate2::{Compression, write::DeflateEncoder};

use super::{
    COMPRESSED, ChunkKind, FileStack, HEADER_LEN, MAGIC, Meta, Module, Stats, Symbol, SymbolKey, VERSION,
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

pub struct Writer<W: Write> {
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

impl<W: Write> Writer<W> {
    /// Writes the header and the `Meta` chunk.
    pub fn new(mut out: W, meta: &Meta) -> io::Result<Self> {
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
        head[5..9].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
        self.out.write_all(&head)?;
        self.out.write_all(payload)?;
        self.bytes_written += (head.len() + payload.len()) as u64;
        Ok(())
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }

    pub fn events_written(&self) -> u64 {
        self.events_written
    }

    /// Events whose chunks reached the output whole: after a failed write, the events a
    /// reader of the file still finds.
    pub fn events_flushed(&self) -> u64 {
        self.events_flushed
    }

    pub fn event(&mut self, event: &Event) -> io::Result<()> {
        self.events.push(event);
        self.events_written += 1;
        if self.events.len() >= EVENTS_CHUNK_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    pub fn module(&mut self, m: &Module) {
        put_varint(&mut self.modules, u64::from(m.id));
        put_bytes(&mut self.modules, &m.build_id);
        put_str(&mut self.modules, &m.path);
    }

    pub fn stack(&mut self, s: &FileStack) {
        self.stacks.push(s);
    }

    pub fn symbol(&mut self, key: SymbolKey, symbols: &[Symbol]) {
        self.symbols.push(key, symbols);
    }

    /// Writes pending definitions, then pending events, and flushes the output.
    pub fn flush(&mut self) -> io::Result<()> {
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

    pub fn stats(&mut self, stats: &Stats) -> io::Result<()> {
        self.flush()?;
        let json = serde_json::to_vec(stats).map_err(io::Error::other)?;
        self.chunk(ChunkKind::Stats, &json, &[])?;
        self.flush_out()
    }

    /// Writes everything pending and hands back the output, without finalizing.
    pub fn into_inner(mut self) -> io::Result<W> {
        self.flush()?;
        Ok(self.out)
    }

    /// Writes everything pending, the final stats and the `End` marker.
    pub fn finish(mut self, stats: &Stats) -> io::Result<W> {
        self.stats(stats)?;
        self.chunk(ChunkKind::End, &[], &[])?;
        self.out.flush()?;
        Ok(self.out)
    }
}
