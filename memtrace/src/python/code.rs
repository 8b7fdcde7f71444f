//! Reading a code object from a live process (`/proc/PID/mem`): its qualified name, file
//! name, first line and line table, from which each frame's line is computed. Once per
//! (process, code object): the cache is dropped when the process execs or exits.
use super::{detect::read_memory, layout::CodeLayout};
use std::sync::Arc;

/// A Python function as frames name it: shared by every frame named from its code object
/// (a frame holds one pointer and its line: PyTorch's 32,768 shared Python stacks held 1.5 M
/// named frames, 40 bytes each with a pointer per name).
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct PyFunction {
    pub qualname: Box<str>,
    pub filename: Box<str>,
}

impl PyFunction {
    pub fn new(qualname: &str, filename: &str) -> Arc<Self> {
        Arc::new(Self { qualname: qualname.into(), filename: filename.into() })
    }
}

/// What a frame shows of its code object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Code {
    pub function: Arc<PyFunction>,
    pub firstlineno: i32,
    pub linetable: Vec<u8>,
    /// The line table is whole (the probes send the first KiB of larger ones).
    pub complete: bool,
}

/// Longest string or line table read (longer ones are cut).
const MAX_READ: usize = 1 << 16;

/// Reads the code object at `addr` in process `pid`.
pub fn read_code(pid: u32, addr: u64, layout: &CodeLayout) -> Option<Code> {
    let header_len = (layout.linetable.max(layout.qualname.unwrap_or(0)) + 8) as usize;
    let header = read_memory(pid, addr, header_len).ok()?;
    let u64_at = |off: u64| -> Option<u64> {
        Some(u64::from_le_bytes(header.get(off as usize..off as usize + 8)?.try_into().ok()?))
    };
    let i32_at = |off: u64| -> Option<i32> {
        Some(i32::from_le_bytes(header.get(off as usize..off as usize + 4)?.try_into().ok()?))
    };
    let firstlineno = i32_at(layout.firstlineno)?;
    let filename = read_str(pid, u64_at(layout.filename)?, layout)?;
    let qualname = read_str(pid, u64_at(layout.qualname.unwrap_or(layout.name))?, layout)?;
    let linetable = read_bytes(pid, u64_at(layout.linetable)?).unwrap_or_default();
    Some(Code { function: PyFunction::new(&qualname, &filename), firstlineno, linetable, complete: true })
}

/// A `str` object: compact ASCII (the usual case for names and paths) or compact
/// 1/2/4-byte characters.
fn read_str(pid: u32, obj: u64, layout: &CodeLayout) -> Option<String> {
    let head = read_memory(pid, obj, 36).ok()?;
    let length = u64::from_le_bytes(head[16..24].try_into().ok()?) as usize;
    let state = u32::from_le_bytes(head[32..36].try_into().ok()?);
    let (kind, compact, ascii) = ((state >> 2) & 7, state & 0x20 != 0, state & 0x40 != 0);
    if !compact || length > MAX_READ {
        return None;
    }
    if ascii {
        let data = read_memory(pid, obj + layout.ascii_data, length).ok()?;
        return String::from_utf8(data).ok();
    }
    let width = kind as usize;
    if !matches!(width, 1 | 2 | 4) {
        return None;
    }
    let data = read_memory(pid, obj + layout.compact_data, length * width).ok()?;
    Some(
        data.chunks_exact(width)
            .map(|c| {
                let mut v = [0u8; 4];
                v[..width].copy_from_slice(c);
                char::from_u32(u32::from_le_bytes(v)).unwrap_or('\u{fffd}')
            })
            .collect(),
    )
}

/// A `bytes` object's contents (`ob_size` at 16, data at 32 on every version).
fn read_bytes(pid: u32, obj: u64) -> Option<Vec<u8>> {
    let head = read_memory(pid, obj, 24).ok()?;
    let size = u64::from_le_bytes(head[16..24].try_into().ok()?) as usize;
    read_memory(pid, obj + 32, size.min(MAX_READ)).ok()
}
