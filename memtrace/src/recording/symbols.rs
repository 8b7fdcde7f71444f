//! The `Symbols` chunk: what each address of the recording's stacks is (function, file,
//! line, inline chain), written while the processes lived so reports work offline.
//!
//! Version 5 keeps each field in a stream of its own and names every string once per chunk:
//! most addresses are return addresses inside a function met before (on the heavy Python
//! bench 15,670 entries hold 4,146 distinct names; written one by one they were 2.3 MB
//! before deflating and 156 KB after).
//!
//! ```text
//! payload  6 stream lengths (varints) | the streams, in this order:
//! keys     per address: 0, zigzag delta from the previous kernel address | 1, module id,
//!          zigzag delta from the previous module offset | 2, bare address
//! counts   per address: its entries (the inline chain, innermost first)
//! names    per entry: a string reference
//! files    per entry: 0 (no file), else 1 + a string reference
//! lines    per entry: line << 1 | inlined
//! strings  the chunk's strings, each the first time it is referred to: length, bytes
//! ```
//! A string reference counts back from the newest string of the chunk: 0 is a new string
//! (the next of `strings`), k ≥ 1 the k-th newest.
//!
//! Versions 2–4 wrote per address: kind byte, key, count, then per entry the name, a flags
//! byte (1: inlined, 2: a file follows), the file and the line.
use std::sync::Arc;

use super::{
    FileFrame, FormatError, Symbol, SymbolKey,
    codec::{Cursor, Streams, put_bytes, put_signed, put_varint},
};

const KEYS: usize = 0;
const COUNTS: usize = 1;
const NAMES: usize = 2;
const FILES: usize = 3;
const LINES: usize = 4;
const STRINGS: usize = 5;
const STREAMS: usize = 6;

/// Encodes symbols into the pending `Symbols` chunk (version 5).
#[derive(Default)]
pub struct SymbolEncoder {
    streams: [Vec<u8>; STREAMS],
    /// The chunk's strings, by their number (in order of first use).
    strings: crate::FastMap<String, u64>,
    prev_kernel: u64,
    prev_offset: u64,
}

impl SymbolEncoder {
    pub fn push(&mut self, key: SymbolKey, symbols: &[Symbol]) {
        let keys = &mut self.streams[KEYS];
        match key {
            SymbolKey::Kernel(addr) => {
                keys.push(0);
                put_signed(keys, addr.wrapping_sub(self.prev_kernel) as i64);
                self.prev_kernel = addr;
            }
            SymbolKey::User(FileFrame::Module { module, offset }) => {
                keys.push(1);
                put_varint(keys, u64::from(module));
                put_signed(keys, offset.wrapping_sub(self.prev_offset) as i64);
                self.prev_offset = offset;
            }
            SymbolKey::User(FileFrame::Address(ip)) => {
                keys.push(2);
                put_varint(keys, ip);
            }
        }
        put_varint(&mut self.streams[COUNTS], symbols.len() as u64);
        for s in symbols {
            let name = self.string(&s.name);
            put_varint(&mut self.streams[NAMES], name);
            let file = s.file.as_deref().map_or(0, |f| 1 + self.string(f));
            put_varint(&mut self.streams[FILES], file);
            put_varint(&mut self.streams[LINES], u64::from(s.line) << 1 | u64::from(s.inlined));
        }
    }

    /// The reference to `s`, writing it out the first time.
    fn string(&mut self, s: &str) -> u64 {
        let count = self.strings.len() as u64;
        match self.strings.get(s) {
            Some(&n) => count - n,
            None => {
                self.strings.insert(s.to_string(), count);
                put_bytes(&mut self.streams[STRINGS], s.as_bytes());
                0
            }
        }
    }

    /// Hands over the chunk's bytes (empty when no symbol came); the next starts afresh.
    pub fn take(&mut self) -> Streams {
        self.strings.clear();
        self.prev_kernel = 0;
        self.prev_offset = 0;
        if self.streams[KEYS].is_empty() {
            return Streams::default();
        }
        Streams::join(&[], &mut self.streams)
    }
}

/// Decodes a version-5 `Symbols` chunk.
pub fn parse_columns(payload: &[u8], offset: u64) -> Result<Vec<(SymbolKey, Vec<Symbol>)>, FormatError> {
    let mut st: [Cursor<'_>; STREAMS] = Cursor::new(payload, offset).streams()?;
    // Shared by every entry naming them (a function's addresses, a file's functions).
    let mut strings: Vec<Arc<str>> = Vec::new();
    let mut string = |st: &mut [Cursor<'_>; STREAMS], stream: usize, back: u64| -> Result<Arc<str>, FormatError> {
        if back == 0 {
            let s: Arc<str> = st[STRINGS].string()?.into();
            strings.push(Arc::clone(&s));
            return Ok(s);
        }
        let i = (strings.len() as u64)
            .checked_sub(back)
            .ok_or_else(|| st[stream].error("string reference out of range"))?;
        Ok(strings[i as usize].clone())
    };
    let (mut prev_kernel, mut prev_offset) = (0u64, 0u64);
    let mut out = Vec::new();
    while !st[KEYS].is_empty() {
        let key = match st[KEYS].u8()? {
            0 => {
                prev_kernel = prev_kernel.wrapping_add(st[KEYS].signed()? as u64);
                SymbolKey::Kernel(prev_kernel)
            }
            1 => {
                let module = st[KEYS].varint_u32()?;
                prev_offset = prev_offset.wrapping_add(st[KEYS].signed()? as u64);
                SymbolKey::User(FileFrame::Module { module, offset: prev_offset })
            }
            2 => SymbolKey::User(FileFrame::Address(st[KEYS].varint()?)),
            other => return Err(st[KEYS].error(&format!("symbol key type {other}"))),
        };
        let n = st[COUNTS].varint()?;
        // Each entry takes at least one byte of each per-entry stream.
        if n > st[NAMES].rest().len() as u64 {
            return Err(st[COUNTS].error("more entries than the chunk holds"));
        }
        let mut symbols = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let back = st[NAMES].varint()?;
            let name = string(&mut st, NAMES, back)?;
            let file = match st[FILES].varint()? {
                0 => None,
                f => Some(string(&mut st, FILES, f - 1)?),
            };
            let line = st[LINES].varint()?;
            let inlined = line & 1 != 0;
            let line = u32::try_from(line >> 1).map_err(|_| st[LINES].error("line out of range"))?;
            symbols.push(Symbol { name, file, line, inlined });
        }
        out.push((key, symbols));
    }
    if st.iter().any(|c| !c.is_empty()) {
        return Err(st[KEYS].error("bytes after the last symbol"));
    }
    Ok(out)
}

/// Decodes a version 2–4 `Symbols` chunk.
pub fn parse_rows(payload: &[u8], offset: u64) -> Result<Vec<(SymbolKey, Vec<Symbol>)>, FormatError> {
    let mut c = Cursor::new(payload, offset);
    let mut out = Vec::new();
    while !c.is_empty() {
        let key = match c.u8()? {
            0 => SymbolKey::Kernel(c.varint()?),
            1 => SymbolKey::User(FileFrame::Module { module: c.varint_u32()?, offset: c.varint()? }),
            2 => SymbolKey::User(FileFrame::Address(c.varint()?)),
            other => {
                return Err(FormatError::Corrupt { offset, reason: format!("symbol key type {other}") });
            }
        };
        let n = c.len(3)?;
        let mut symbols = Vec::with_capacity(n);
        for _ in 0..n {
            let name = c.string()?.into();
            let bits = c.u8()?;
            let file = if bits & 2 != 0 { Some(c.string()?.into()) } else { None };
            let line = c.varint_u32()?;
            symbols.push(Symbol { name, file, line, inlined: bits & 1 != 0 });
        }
        out.push((key, symbols));
    }
    Ok(out)
}

/// A version 2–4 `Symbols` chunk (for the tests that make older recordings).
#[cfg(test)]
pub fn encode_rows(out: &mut Vec<u8>, key: SymbolKey, symbols: &[Symbol]) {
    use super::codec::put_str;
    match key {
        SymbolKey::Kernel(addr) => {
            out.push(0);
            put_varint(out, addr);
        }
        SymbolKey::User(FileFrame::Module { module, offset }) => {
            out.push(1);
            put_varint(out, u64::from(module));
            put_varint(out, offset);
        }
        SymbolKey::User(FileFrame::Address(ip)) => {
            out.push(2);
            put_varint(out, ip);
        }
    }
    put_varint(out, symbols.len() as u64);
    for s in symbols {
        put_str(out, &s.name);
        out.push(u8::from(s.inlined) | (u8::from(s.file.is_some()) << 1));
        if let Some(file) = &s.file {
            put_str(out, file);
        }
        put_varint(out, u64::from(s.line));
    }
}
