//! The `Stacks` chunk. Version 4 stores each chunk's stacks as a tree of frames, from the
//! outermost (user `_start`, then the kernel's entry) inwards, as heaptrack's trace tree
//! does: a stack names the deepest node it shares with the stacks before it in the chunk and
//! adds only the frames below that. Deep stacks that differ in their innermost frames (an
//! interpreter's thousands of call sites under one `main`) cost a few frames each, not a
//! hundred. Versions 2–3 stored every frame of every stack.
//!
//! ```text
//! stack    id | pid | truncated | node shared (0: none) | count of new frames | new frames,
//!          outermost first (all varints)
//! frame    0, address | 1, !kernel address | 2 + module id, file offset
//! ```
//! Node n (from 1) is the n-th new frame of the chunk; its parent is the node before it in
//! its stack (or the shared node).

use super::{
    FileFrame, FileStack, FormatError,
    codec::{Cursor, put_varint},
};

/// Frames a decoded stack may have: a chain longer than this is corrupt (the probes walk
/// far fewer), and the bound keeps a hostile file from costing quadratic time.
const MAX_DECODED_FRAMES: u32 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Frame {
    Kernel(u64),
    User(FileFrame),
}

fn put_frame(out: &mut Vec<u8>, frame: Frame) {
    match frame {
        Frame::User(FileFrame::Address(ip)) => {
            put_varint(out, 0);
            put_varint(out, ip);
        }
        Frame::Kernel(addr) => {
            put_varint(out, 1);
            // Kernel text sits at the top of the address space: its complement is small.
            put_varint(out, !addr);
        }
        Frame::User(FileFrame::Module { module, offset }) => {
            put_varint(out, u64::from(module) + 2);
            put_varint(out, offset);
        }
    }
}

fn frame(c: &mut Cursor<'_>) -> Result<Frame, FormatError> {
    let tag = c.varint()?;
    let value = c.varint()?;
    Ok(match tag {
        0 => Frame::User(FileFrame::Address(value)),
        1 => Frame::Kernel(!value),
        _ => {
            let module = u32::try_from(tag - 2).map_err(|_| c.error("module id out of range"))?;
            Frame::User(FileFrame::Module { module, offset: value })
        }
    })
}

/// Encodes stacks into the pending `Stacks` chunk, sharing frames with the chunk's earlier
/// stacks.
#[derive(Default)]
pub struct StackEncoder {
    pub buf: Vec<u8>,
    nodes: crate::FastMap<(u32, Frame), u32>,
    path: Vec<Frame>,
}

impl StackEncoder {
    pub fn push(&mut self, s: &FileStack) {
        self.path.clear();
        self.path.extend(s.user.iter().rev().map(|&f| Frame::User(f)));
        self.path.extend(s.kernel.iter().rev().map(|&a| Frame::Kernel(a)));
        let mut node = 0u32;
        let mut shared = 0;
        while let Some(&next) = self.path.get(shared).and_then(|&f| self.nodes.get(&(node, f))) {
            node = next;
            shared += 1;
        }
        let out = &mut self.buf;
        put_varint(out, u64::from(s.id));
        put_varint(out, u64::from(s.pid));
        put_varint(out, u64::from(s.truncated));
        put_varint(out, u64::from(node));
        put_varint(out, (self.path.len() - shared) as u64);
        for &f in &self.path[shared..] {
            put_frame(out, f);
            let id = self.nodes.len() as u32 + 1;
            self.nodes.insert((node, f), id);
            node = id;
        }
    }

    /// Hands over the chunk's bytes; the next stack starts a new chunk (and a new tree).
    pub fn take(&mut self) -> Vec<u8> {
        self.nodes.clear();
        std::mem::take(&mut self.buf)
    }
}

/// Decodes a version-4 `Stacks` chunk.
pub fn parse_tree(payload: &[u8], offset: u64) -> Result<Vec<FileStack>, FormatError> {
    let mut c = Cursor::new(payload, offset);
    // Node n - 1: (parent, frame, depth).
    let mut nodes: Vec<(u32, Frame, u32)> = Vec::new();
    let mut out = Vec::new();
    while !c.is_empty() {
        let id = c.varint_u32()?;
        let pid = c.varint_u32()?;
        let truncated = c.varint()? & 1 != 0;
        let mut node = c.varint_u32()?;
        if node as usize > nodes.len() {
            return Err(c.error("stack node out of range"));
        }
        let new = c.len(2)?;
        for _ in 0..new {
            let f = frame(&mut c)?;
            let depth = if node == 0 { 1 } else { nodes[node as usize - 1].2 + 1 };
            if depth > MAX_DECODED_FRAMES {
                return Err(c.error("stack deeper than any walk"));
            }
            nodes.push((node, f, depth));
            node = nodes.len() as u32;
        }
        let (mut kernel, mut user) = (Vec::new(), Vec::new());
        while node != 0 {
            let (parent, f, _) = nodes[node as usize - 1];
            match f {
                Frame::Kernel(a) => kernel.push(a),
                Frame::User(f) => user.push(f),
            }
            node = parent;
        }
        out.push(FileStack { id, pid, kernel, user, truncated });
    }
    Ok(out)
}

/// Decodes a version 2–3 `Stacks` chunk: every frame of every stack.
pub fn parse_flat(payload: &[u8], offset: u64) -> Result<Vec<FileStack>, FormatError> {
    let mut c = Cursor::new(payload, offset);
    let mut out = Vec::new();
    while !c.is_empty() {
        let id = c.varint_u32()?;
        let pid = c.varint_u32()?;
        let truncated = c.varint()? & 1 != 0;
        let nk = c.len(1)?;
        let mut kernel = Vec::with_capacity(nk);
        let mut prev = 0u64;
        for _ in 0..nk {
            prev = prev.wrapping_add(c.signed()? as u64);
            kernel.push(prev);
        }
        let nu = c.len(2)?;
        let mut user = Vec::with_capacity(nu);
        for _ in 0..nu {
            let tag = c.varint()?;
            let value = c.varint()?;
            user.push(if tag == 0 {
                FileFrame::Address(value)
            } else {
                let module = u32::try_from(tag - 1).map_err(|_| c.error("module id out of range"))?;
                FileFrame::Module { module, offset: value }
            });
        }
        out.push(FileStack { id, pid, kernel, user, truncated });
    }
    Ok(out)
}

/// A version 2–3 `Stacks` chunk (for the tests that make older recordings).
#[cfg(test)]
pub fn encode_flat(out: &mut Vec<u8>, s: &FileStack) {
    put_varint(out, u64::from(s.id));
    put_varint(out, u64::from(s.pid));
    put_varint(out, u64::from(s.truncated));
    put_varint(out, s.kernel.len() as u64);
    let mut prev = 0u64;
    for &addr in &s.kernel {
        super::codec::put_signed(out, addr.wrapping_sub(prev) as i64);
        prev = addr;
    }
    put_varint(out, s.user.len() as u64);
    for frame in &s.user {
        match *frame {
            FileFrame::Address(ip) => {
                put_varint(out, 0);
                put_varint(out, ip);
            }
            FileFrame::Module { module, offset } => {
                put_varint(out, u64::from(module) + 1);
                put_varint(out, offset);
            }
        }
    }
}
