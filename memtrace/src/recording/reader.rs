//! Reading a recording chunk by chunk (streaming, for large files) or whole.
use std::{
    fs::File,
    io::{self, BufReader, Read},
    path::Path,
};

use flate2::read::DeflateDecoder;

use super::{
    COMPRESSED, ChunkKind, FileStack, FormatError, HEADER_LEN, MAGIC, MAX_CHUNK, Meta, Module, Recording, Stats,
    Symbol, SymbolKey, VERSION, chunk_crc, codec::Cursor, events::decode_chunk, events_rows::decode_rows, stacks,
    symbols,
};
use crate::event::Event;

pub enum Chunk {
    /// An `Events` payload; decode it with [`Reader::decode_events`].
    Events {
        payload: Vec<u8>,
        offset: u64,
        /// The recording's format version (the layout of the payload).
        version: u16,
    },
    Stacks(Vec<FileStack>),
    Modules(Vec<Module>),
    Symbols(Vec<(SymbolKey, Vec<Symbol>)>),
    Stats(Box<Stats>),
    End,
}

pub struct Reader<R: Read> {
    input: R,
    offset: u64,
    version: u16,
    pub meta: Meta,
    /// Chunks skipped for failing their checksum.
    damaged: u32,
    /// The last chunk read failed its checksum: the next header must look like one (the
    /// damage may have been in the length, which led here).
    after_damage: bool,
    /// Only chunks of these kinds are inflated; the others are checked and skipped
    /// ([`Reader::only`]).
    only: Option<&'static [ChunkKind]>,
}

/// Damaged chunks skipped at most before the file is taken as unreadable past there.
const MAX_DAMAGED: u32 = 64;

/// Reads until `buf` is full; returns how many bytes were read (short only at EOF).
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

impl Reader<BufReader<File>> {
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        Self::new(BufReader::with_capacity(1 << 20, File::open(path)?))
    }
}

/// Whether release `theirs` ("0.2.0") is later than `ours`: the release numbers compared
/// in order (a missing one counts as 0, one that is not a number too); of one release, a
/// pre-release ("0.2.0-rc1") comes before the release itself.
fn newer_release(theirs: &str, ours: &str) -> bool {
    let parse = |v: &str| -> (Vec<u64>, bool) {
        let core = v.split('+').next().unwrap_or(v);
        let (numbers, pre) = match core.split_once('-') {
            Some((numbers, _)) => (numbers, true),
            None => (core, false),
        };
        let mut parts: Vec<u64> = numbers.split('.').map(|p| p.parse().unwrap_or(0)).collect();
        while parts.last() == Some(&0) {
            parts.pop();
        }
        (parts, pre)
    };
    let ((theirs, their_pre), (ours, our_pre)) = (parse(theirs), parse(ours));
    theirs > ours || (theirs == ours && our_pre && !their_pre)
}

/// What a newer format's metadata must still say: which memtrace wrote it (the rest of
/// its shape may have changed).
#[derive(serde::Deserialize)]
struct Writer {
    memtrace_version: String,
}

impl<R: Read> Reader<R> {
    /// Checks the header and reads the `Meta` chunk.
    pub fn new(mut input: R) -> Result<Self, FormatError> {
        let mut header = [0u8; HEADER_LEN];
        let n = read_full(&mut input, &mut header)?;
        if n < MAGIC.len() || &header[..8] != MAGIC {
            return Err(FormatError::NotMemtrace);
        }
        if n < HEADER_LEN {
            return Err(FormatError::Truncated { offset: 0, end: n as u64 });
        }
        let version = u16::from_le_bytes([header[8], header[9]]);
        if header[11] != 8 {
            return Err(FormatError::Corrupt { offset: 11, reason: format!("pointer size {}", header[11]) });
        }
        let mut reader = Self {
            input,
            offset: HEADER_LEN as u64,
            version,
            meta: Meta::default(),
            damaged: 0,
            after_damage: false,
            only: None,
        };
        if version > VERSION {
            // The header has no checksum: a version byte damaged reads as "newer". The
            // metadata chunk (checksummed) says which memtrace wrote the file.
            let writer = match reader.raw_chunk() {
                Ok(Some((ChunkKind::Meta, payload, _))) => {
                    serde_json::from_slice::<Writer>(&payload).ok().map(|m| m.memtrace_version)
                }
                _ => None,
            };
            return Err(match writer {
                Some(w) if newer_release(&w, env!("CARGO_PKG_VERSION")) => FormatError::UnsupportedVersion(version),
                Some(w) => FormatError::Corrupt {
                    offset: 8,
                    reason: format!("damaged header: format version {version}, in a file memtrace {w} wrote"),
                },
                None => FormatError::Corrupt {
                    offset: 8,
                    reason: format!("format version {version}: a newer format, or a damaged header"),
                },
            });
        }
        // The header has no checksum: each byte of a format this release knows is checked
        // for what it may hold (a newer one may give them meanings).
        if !matches!(header[10], 1 | 2) {
            return Err(FormatError::Corrupt { offset: 10, reason: format!("byte order {}", header[10]) });
        }
        if header[12] > super::CLOCK_MONOTONIC {
            return Err(FormatError::Corrupt { offset: 12, reason: format!("clock {}", header[12]) });
        }
        if let Some(i) = (13..HEADER_LEN).find(|&i| header[i] != 0) {
            return Err(FormatError::Corrupt { offset: i as u64, reason: format!("reserved byte {}", header[i]) });
        }
        match reader.raw_chunk()? {
            Some((ChunkKind::Meta, payload, offset)) => {
                reader.meta = serde_json::from_slice(&payload)
                    .map_err(|e| FormatError::Corrupt { offset, reason: format!("metadata: {e}") })?;
            }
            Some(_) => {
                return Err(FormatError::Corrupt { offset: HEADER_LEN as u64, reason: "no metadata chunk".into() });
            }
            None => {
                return Err(FormatError::Truncated { offset: HEADER_LEN as u64, end: HEADER_LEN as u64 });
            }
        }
        Ok(reader)
    }

    /// Next chunk: `Ok(None)` at a clean end of file.
    fn raw_chunk(&mut self) -> Result<Option<(ChunkKind, Vec<u8>, u64)>, FormatError> {
        loop {
            let start = self.offset;
            let mut head = [0u8; 9];
            let n = read_full(&mut self.input, &mut head)?;
            if n == 0 {
                return Ok(None);
            }
            if n < head.len() {
                return Err(FormatError::Truncated { offset: start, end: start + n as u64 });
            }
            let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes"));
            let crc = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes"));
            if len > MAX_CHUNK {
                return Err(FormatError::Corrupt { offset: start, reason: format!("chunk of {len} bytes") });
            }
            if self.after_damage && ChunkKind::from_u8(head[0] & !COMPRESSED).is_none() {
                return Err(FormatError::Corrupt {
                    offset: start,
                    reason: "no chunk starts after the damaged one (its length may be what was damaged)".into(),
                });
            }
            let mut payload = vec![0u8; len as usize];
            let got = read_full(&mut self.input, &mut payload)?;
            if got < payload.len() {
                return Err(FormatError::Truncated { offset: start, end: start + 9 + got as u64 });
            }
            self.offset = start + 9 + u64::from(len);
            if chunk_crc(self.version, head[0], len, &payload) != crc {
                self.damaged += 1;
                if self.damaged > MAX_DAMAGED {
                    return Err(FormatError::Corrupt {
                        offset: start,
                        reason: format!("more than {MAX_DAMAGED} chunks fail their checksum"),
                    });
                }
                self.after_damage = true;
                return Err(FormatError::Damaged { offset: start, len });
            }
            self.after_damage = false;
            match ChunkKind::from_u8(head[0] & !COMPRESSED) {
                Some(kind) if self.only.is_some_and(|only| !only.contains(&kind)) => continue,
                Some(kind) if head[0] & COMPRESSED != 0 => {
                    return Ok(Some((kind, inflate(&payload, start)?, start + 9)));
                }
                Some(kind) => return Ok(Some((kind, payload, start + 9))),
                None => continue, // a chunk kind from a newer minor version: skip it
            }
        }
    }

    pub fn next_chunk(&mut self) -> Result<Option<Chunk>, FormatError> {
        self.next_chunk_with(true)
    }

    /// Where the next chunk starts in the file.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The next `Events` chunk, the chunks before it skipped without being parsed (the
    /// definitions were read before, by [`Reader::next_chunk`]); a second metadata chunk
    /// is damage, as there.
    pub fn next_events_chunk(&mut self) -> Result<Option<Chunk>, FormatError> {
        loop {
            let Some((kind, payload, offset)) = self.raw_chunk()? else {
                return Ok(None);
            };
            match kind {
                ChunkKind::Events => return Ok(Some(Chunk::Events { payload, offset, version: self.version })),
                ChunkKind::Meta => {
                    return Err(FormatError::Corrupt { offset, reason: "second metadata chunk".into() });
                }
                _ => {}
            }
        }
    }

    /// From now on only chunks of `kinds` are returned: the others are read and checked
    /// (their checksums, their lengths) but neither inflated nor parsed. A pass over a
    /// file's outline (`dump`: its counters and its damage) costs its reading only.
    pub fn only(&mut self, kinds: &'static [ChunkKind]) {
        self.only = Some(kinds);
    }

    /// As [`Reader::next_chunk`], but the stacks of a format-5 (or later) `Stacks` chunk
    /// come without their frames (id, process and cut only: [`stacks::parse_heads`]).
    pub fn next_chunk_without_frames(&mut self) -> Result<Option<Chunk>, FormatError> {
        self.next_chunk_with(false)
    }

    fn next_chunk_with(&mut self, frames: bool) -> Result<Option<Chunk>, FormatError> {
        let Some((kind, payload, offset)) = self.raw_chunk()? else {
            return Ok(None);
        };
        if kind == ChunkKind::Stacks && self.version >= 5 && !frames {
            return Ok(Some(Chunk::Stacks(stacks::parse_heads(&payload, offset)?)));
        }
        Ok(Some(match kind {
            ChunkKind::Meta => {
                return Err(FormatError::Corrupt { offset, reason: "second metadata chunk".into() });
            }
            ChunkKind::Events => Chunk::Events { payload, offset, version: self.version },
            ChunkKind::Stacks if self.version >= 5 => Chunk::Stacks(stacks::parse_columns(&payload, offset)?),
            ChunkKind::Stacks if self.version == 4 => Chunk::Stacks(stacks::parse_tree(&payload, offset)?),
            ChunkKind::Stacks => Chunk::Stacks(stacks::parse_flat(&payload, offset)?),
            ChunkKind::Modules => Chunk::Modules(parse_modules(&payload, offset)?),
            ChunkKind::Symbols if self.version >= 5 => Chunk::Symbols(symbols::parse_columns(&payload, offset)?),
            ChunkKind::Symbols => Chunk::Symbols(symbols::parse_rows(&payload, offset)?),
            ChunkKind::Stats => Chunk::Stats(Box::new(
                serde_json::from_slice(&payload)
                    .map_err(|e| FormatError::Corrupt { offset, reason: format!("stats: {e}") })?,
            )),
            ChunkKind::End => Chunk::End,
        }))
    }
}

/// Decodes an `Events` chunk payload of a recording of format `version`, calling `sink` per
/// event; returns the count.
pub fn decode_events(
    payload: &[u8],
    offset: u64,
    version: u16,
    sink: &mut dyn FnMut(Event),
) -> Result<u32, FormatError> {
    if version >= 4 { decode_chunk(payload, offset, version, sink) } else { decode_rows(payload, offset, sink) }
}

/// The payload of a deflated chunk (stored at `offset`): exactly the length it announces,
/// never more than [`MAX_CHUNK`].
fn inflate(stored: &[u8], offset: u64) -> Result<Vec<u8>, FormatError> {
    let corrupt = |reason: String| FormatError::Corrupt { offset, reason };
    let mut c = Cursor::new(stored, offset);
    let len = c.varint()?;
    if len > u64::from(MAX_CHUNK) {
        return Err(corrupt(format!("a chunk inflating to {len} bytes")));
    }
    let body = c.rest();
    let mut out = Vec::with_capacity(len as usize);
    DeflateDecoder::new(body)
        .take(len + 1)
        .read_to_end(&mut out)
        .map_err(|e| corrupt(format!("compressed chunk: {e}")))?;
    if out.len() as u64 != len {
        return Err(corrupt(format!("a compressed chunk gave {} bytes, not {len}", out.len())));
    }
    Ok(out)
}

fn parse_modules(payload: &[u8], offset: u64) -> Result<Vec<Module>, FormatError> {
    let mut c = Cursor::new(payload, offset);
    let mut out = Vec::new();
    while !c.is_empty() {
        out.push(Module { id: c.varint_u32()?, build_id: c.bytes()?.to_vec(), path: c.string()? });
    }
    Ok(out)
}

/// Reads a whole recording into memory. Fails only if the header or metadata are unusable;
/// damage further in ends the read early with a warning in `Recording::warnings`.
pub fn read_all(input: impl Read) -> Result<Recording, FormatError> {
    let mut reader = Reader::new(input)?;
    let mut rec = Recording { meta: reader.meta.clone(), ..Default::default() };
    loop {
        let chunk = match reader.next_chunk() {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            // Its extent is known: the chunks after it read.
            Err(e @ FormatError::Damaged { .. }) => {
                rec.warnings.push(format!("{e}: skipped"));
                continue;
            }
            Err(e) => {
                rec.warnings.push(format!("{e}; reporting the complete part before it"));
                break;
            }
        };
        match chunk {
            Chunk::Events { payload, offset, version } => {
                let mut batch = Vec::new();
                match decode_events(&payload, offset, version, &mut |e| batch.push(e)) {
                    Ok(_) => rec.events.extend(batch),
                    Err(e) => {
                        rec.warnings.push(format!("{e}; reporting the complete part before it"));
                        break;
                    }
                }
            }
            Chunk::Stacks(stacks) => rec.stacks.extend(stacks.into_iter().map(|s| (s.id, s))),
            Chunk::Modules(modules) => rec.modules.extend(modules.into_iter().map(|m| (m.id, m))),
            Chunk::Symbols(symbols) => rec.symbols.extend(symbols),
            Chunk::Stats(stats) => rec.stats = *stats,
            Chunk::End => rec.finalized = true,
        }
    }
    if !rec.finalized && rec.warnings.is_empty() {
        rec.warnings
            .push("the recording was not finalized (memtrace stopped abruptly); figures cover what was written".into());
    }
    Ok(rec)
}

#[cfg(test)]
mod tests {
    #[test]
    fn releases_compare_by_their_numbers() {
        assert!(super::newer_release("0.10.0", "0.9.1"));
        assert!(super::newer_release("1.0.0", "0.99.0"));
        assert!(!super::newer_release("0.1.0", "0.1.0"));
        assert!(!super::newer_release("test", "0.1.0"));
        assert!(!super::newer_release("0.2.0-rc1", "0.2.0"));
        assert!(super::newer_release("0.2.0", "0.2.0-rc1"));
        assert!(super::newer_release("0.2.1-rc1", "0.2.0"));
        assert!(!super::newer_release("0.2", "0.2.0"));
        assert!(!super::newer_release("0.2.0+build5", "0.2.0"));
    }
}
