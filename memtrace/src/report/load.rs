//! Reading a recording for analysis: the definitions (stacks, modules, symbols, stats; a
//! chunk that fails its checksum is skipped, with a warning, and a file damaged otherwise or
//! unfinished is read up to the damage), then the events, streamed. `report`, `export` and `dump` read recordings through these.
use std::{collections::BTreeMap, fs::File, io::BufReader, path::Path};

use anyhow::{Context as _, Result};

use crate::{
    event::Event,
    recording::{self, FormatError, Meta, Module, Reader, Symbol, SymbolKey},
    stack_store::StackStore,
    stacks::StackTable,
};

/// Everything in a recording but its events.
pub struct Definitions {
    pub meta: Meta,
    pub stacks: StackTable,
    pub stats: recording::Stats,
    /// The recording ends with its end marker (memtrace stopped cleanly).
    pub finalized: bool,
    /// Damage met while reading, for the report to show.
    pub warnings: Vec<String>,
    /// Where the damaged chunk starts: the events are read up to there.
    pub damaged_at: Option<u64>,
    /// Chunks that failed their checksum and were skipped (what they held is missing).
    pub skipped: usize,
}

/// Reads the definitions of a recording (everything but the events).
pub fn read_definitions(path: &Path) -> Result<Definitions> {
    let mut reader = Reader::open(path).with_context(|| format!("reading {}", path.display()))?;
    let meta = reader.meta.clone();
    // Stacks go into the shared tree as each chunk is read: a heavy program's million
    // stacks held as vectors of frames first took gigabytes.
    let mut stacks = StackStore::default();
    let mut modules: BTreeMap<u32, Module> = BTreeMap::new();
    let mut symbols: Vec<(SymbolKey, Vec<Symbol>)> = Vec::new();
    let mut stats = recording::Stats::default();
    let mut finalized = false;
    let mut warnings = Vec::new();
    let mut damaged_at = None;
    let mut skipped = 0;
    loop {
        let at = reader.offset();
        match reader.next_chunk() {
            Ok(None) => break,
            Ok(Some(chunk)) => match chunk {
                recording::Chunk::Stacks(s) => s.iter().for_each(|s| stacks.insert(s)),
                recording::Chunk::Modules(m) => modules.extend(m.into_iter().map(|m| (m.id, m))),
                recording::Chunk::Symbols(s) => symbols.extend(s),
                recording::Chunk::Stats(s) => stats = *s,
                recording::Chunk::End => finalized = true,
                recording::Chunk::Events { .. } => {}
            },
            // A chunk that fails its checksum is skipped: what follows it still reads.
            Err(e @ FormatError::Damaged { .. }) => {
                skipped += 1;
                warnings.push(format!("{e}: skipped (the events, stacks or names it held are missing)"));
            }
            Err(e) => {
                warnings.push(format!("{e}; only the complete part before it is read"));
                damaged_at = Some(at);
                break;
            }
        }
    }
    if !finalized && warnings.is_empty() {
        warnings.push("the recording was not finalized (memtrace stopped abruptly); what was written is read".into());
    }
    Ok(Definitions {
        meta,
        stacks: StackTable::with_store(stacks, modules, symbols),
        stats,
        finalized,
        warnings,
        damaged_at,
        skipped,
    })
}

/// What a pass over a recording's chunks tells without inflating those of events or
/// definitions: its counters, and the damage [`read_definitions`] warns of.
pub struct Outline {
    pub stats: recording::Stats,
    /// As [`Definitions::warnings`].
    pub warnings: Vec<String>,
    /// As [`Definitions::damaged_at`].
    pub damaged_at: Option<u64>,
}

/// Reads a recording's outline (`dump` without stacks).
pub fn read_outline(path: &Path) -> Result<Outline> {
    let mut reader = Reader::open(path).with_context(|| format!("reading {}", path.display()))?;
    reader.only(&[recording::ChunkKind::Stats, recording::ChunkKind::End]);
    let (mut stats, mut finalized, mut warnings, mut damaged_at) =
        (recording::Stats::default(), false, Vec::new(), None);
    loop {
        let at = reader.offset();
        match reader.next_chunk_without_frames() {
            Ok(None) => break,
            Ok(Some(recording::Chunk::Stats(s))) => stats = *s,
            Ok(Some(recording::Chunk::End)) => finalized = true,
            Ok(Some(_)) => {}
            Err(e @ FormatError::Damaged { .. }) => {
                warnings.push(format!("{e}: skipped (the events it held are missing)"))
            }
            Err(e) => {
                warnings.push(format!("{e}; what follows covers the complete part before it"));
                damaged_at = Some(at);
                break;
            }
        }
    }
    if !finalized && warnings.is_empty() {
        warnings.push("the recording was not finalized (memtrace stopped abruptly); it holds what was written".into());
    }
    Ok(Outline { stats, warnings, damaged_at })
}

/// Streams every event of a recording to `sink`, up to the chunk at `until` (where
/// `read_definitions` met damage it could not read past); skips a chunk that fails its
/// checksum and stops quietly at other damage. The chunks
/// of definitions are skipped, not parsed again (on the heavy Python bench's recording
/// parsing its stacks a second time took most of this pass).
pub fn for_each_event(path: &Path, until: Option<u64>, sink: &mut dyn FnMut(Event)) -> Result<(), FormatError> {
    let mut reader = Reader::new(BufReader::with_capacity(1 << 20, File::open(path)?))?;
    // A chunk starting at `until` or after is not read; one reached past skipped chunks
    // (its payload follows its 9-byte head) is not decoded.
    let before = |at: u64| until.is_none_or(|until| at < until);
    while before(reader.offset()) {
        let chunk = match reader.next_events_chunk() {
            Ok(Some(chunk)) => chunk,
            // Skipped, as `read_definitions` did (and said).
            Err(FormatError::Damaged { .. }) => continue,
            Ok(None) | Err(_) => break,
        };
        let recording::Chunk::Events { payload, offset, version } = chunk else { continue };
        if !before(offset.saturating_sub(9)) || recording::decode_events(&payload, offset, version, sink).is_err() {
            break;
        }
    }
    Ok(())
}
