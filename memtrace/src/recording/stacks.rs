//! The `Stacks` chunk. Since version 4 a chunk's stacks form a tree of frames, from the
//! outermost (user `_start`, then the kernel's entry) inwards, as heaptrack's trace tree
//! does: a stack names the deepest node it shares with the stacks before it in the chunk and
//! adds only the frames below that. Deep stacks that differ in their innermost frames (an
//! interpreter's thousands of call sites under one `main`) cost a few frames each, not a
//! hundred. Versions 2–3 stored every frame of every stack.
//!
//! Version 5 keeps each field in a stream of its own, as the events do, so that deflate
//! meets runs of like values (on the heavy Python bench: 477 KB → ~250 KB of stacks; the
//! node references and frame tags interleaved with the addresses were most of it):
//!
//! ```text
//! payload  7 stream lengths (varints) | the streams, in this order:
//! heads    per stack: zigzag id delta from the previous stack of the chunk, pid, truncated
//! shared   per stack: 0 (shares nothing); 2k + 1: the previous stack's frames less its k
//!          innermost; 2b (b ≥ 1): the node made b - 1 nodes before the newest
//! counts   per stack: its new frames
//! kinds    per new frame, outermost first: 0 bare address, 1 kernel, 2 + module id
//! offsets  per module frame: its file offset, or, when its parent node has a child in the
//!          same module already (another line of the same caller, another call site of
//!          the same function), the zigzag delta from the newest such child's offset
//! kernel   per kernel frame: the address's complement (kernel text sits at the top of the
//!          address space)
//! addrs    per bare address: the address
//! ```
//! Version 4 wrote per stack: id | pid | truncated | node shared (0: none) | count of new
//! frames | new frames (0, address | 1, !kernel address | 2 + module id, file offset), all
//! varints. Node n (from 1) is the n-th new frame of the chunk; its parent is the node
//! before it in its stack (or the shared node).

use super::{
    FileFrame, FileStack, FormatError,
    codec::{Cursor, Streams, put_signed, put_varint, unzigzag, zigzag},
};

/// Frames a decoded stack may have: a chain longer than this is corrupt (the probes walk
/// far fewer), and the bound keeps a hostile file from costing quadratic time.
const MAX_DECODED_FRAMES: u32 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Frame {
    Kernel(u64),
    User(FileFrame),
}

#[cfg(test)]
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

const HEADS: usize = 0;
const SHARED: usize = 1;
const COUNTS: usize = 2;
const KINDS: usize = 3;
const OFFSETS: usize = 4;
const KERNEL: usize = 5;
const ADDRS: usize = 6;
const STREAMS: usize = 7;

/// The frames of `s` from the outermost in: user frames, then kernel frames.
fn outermost_first(s: &FileStack, path: &mut Vec<Frame>) {
    path.clear();
    path.extend(s.user.iter().rev().map(|&f| Frame::User(f)));
    path.extend(s.kernel.iter().rev().map(|&a| Frame::Kernel(a)));
}

/// The tree of a chunk's stacks: node ids by (parent, frame).
#[derive(Default)]
struct Tree {
    nodes: crate::FastMap<(u32, Frame), u32>,
}

impl Tree {
    /// The nodes `path` shares with the tree, outermost first, into `ids`. The frames it
    /// shares with the previous stack (`prev`, whose nodes are `prev_ids`) are those nodes,
    /// found without a lookup: most stacks differ from the one before only near the top.
    fn shared(&self, path: &[Frame], prev: &[Frame], prev_ids: &[u32], ids: &mut Vec<u32>) {
        ids.clear();
        let common = path.iter().zip(prev).take_while(|(a, b)| a == b).count().min(prev_ids.len());
        ids.extend_from_slice(&prev_ids[..common]);
        let mut node = ids.last().copied().unwrap_or(0);
        while let Some(&next) = path.get(ids.len()).and_then(|&f| self.nodes.get(&(node, f))) {
            node = next;
            ids.push(node);
        }
    }

    /// Adds `frame` under `parent`; the new node's id.
    fn add(&mut self, parent: u32, frame: Frame) -> u32 {
        let id = self.nodes.len() as u32 + 1;
        self.nodes.insert((parent, frame), id);
        id
    }

    fn len(&self) -> u32 {
        self.nodes.len() as u32
    }
}

/// The newest offset of a module frame under each (parent node, module): version 5 writes
/// a module frame's offset from its newest sibling's in the same module.
#[derive(Default)]
struct Siblings(crate::FastMap<(u32, u32), u64>);

impl Siblings {
    /// What the offsets stream holds for `offset` under `parent` (and remembers it).
    fn encode(&mut self, parent: u32, module: u32, offset: u64) -> u64 {
        match self.0.insert((parent, module), offset) {
            Some(sibling) => zigzag(offset.wrapping_sub(sibling) as i64),
            None => offset,
        }
    }

    /// The offset `value` of the offsets stream stands for (and remembers it).
    fn decode(&mut self, parent: u32, module: u32, value: u64) -> u64 {
        let entry = self.0.entry((parent, module));
        let offset = match &entry {
            std::collections::hash_map::Entry::Occupied(o) => o.get().wrapping_add(unzigzag(value) as u64),
            std::collections::hash_map::Entry::Vacant(_) => value,
        };
        *entry.or_default() = offset;
        offset
    }
}

/// Encodes stacks into the pending `Stacks` chunk (version 5), sharing frames with the
/// chunk's earlier stacks.
#[derive(Default)]
pub struct StackEncoder {
    streams: [Vec<u8>; STREAMS],
    tree: Tree,
    siblings: Siblings,
    path: Vec<Frame>,
    /// The frames of the previous stack, outermost first.
    prev_path: Vec<Frame>,
    /// The nodes of the previous stack, outermost first, and of this one.
    prev_ids: Vec<u32>,
    ids: Vec<u32>,
    prev_id: u32,
}

impl StackEncoder {
    pub fn push(&mut self, s: &FileStack) {
        std::mem::swap(&mut self.path, &mut self.prev_path);
        outermost_first(s, &mut self.path);
        self.tree.shared(&self.path, &self.prev_path, &self.prev_ids, &mut self.ids);
        let shared = self.ids.len();
        let mut node = self.ids.last().copied().unwrap_or(0);
        let out = &mut self.streams;
        put_signed(&mut out[HEADS], i64::from(s.id) - i64::from(self.prev_id));
        put_varint(&mut out[HEADS], u64::from(s.pid));
        put_varint(&mut out[HEADS], u64::from(s.truncated));
        self.prev_id = s.id;
        let reference = if node == 0 {
            0
        } else if self.prev_ids.get(shared - 1) == Some(&node) {
            2 * (self.prev_ids.len() - shared) as u64 + 1
        } else {
            2 * u64::from(self.tree.len() + 1 - node)
        };
        put_varint(&mut out[SHARED], reference);
        put_varint(&mut out[COUNTS], (self.path.len() - shared) as u64);
        for &f in &self.path[shared..] {
            match f {
                Frame::User(FileFrame::Address(ip)) => {
                    out[KINDS].push(0);
                    put_varint(&mut out[ADDRS], ip);
                }
                Frame::Kernel(addr) => {
                    out[KINDS].push(1);
                    put_varint(&mut out[KERNEL], !addr);
                }
                Frame::User(FileFrame::Module { module, offset }) => {
                    put_varint(&mut out[KINDS], u64::from(module) + 2);
                    put_varint(&mut out[OFFSETS], self.siblings.encode(node, module, offset));
                }
            }
            node = self.tree.add(node, f);
            self.ids.push(node);
        }
        std::mem::swap(&mut self.prev_ids, &mut self.ids);
    }

    /// Lets go of what was grown for earlier chunks (the tree's table, kept for the next
    /// chunk otherwise), when no chunk is being filled.
    pub fn release(&mut self) {
        if self.streams[HEADS].is_empty() {
            *self = Self::default();
        }
    }

    /// Nodes of the chunk's tree so far.
    pub fn nodes(&self) -> u32 {
        self.tree.len()
    }

    /// Hands over the chunk's bytes (empty when no stack came); the next stack starts a new
    /// chunk (and a new tree).
    pub fn take(&mut self) -> Streams {
        self.tree.nodes.clear();
        self.siblings.0.clear();
        self.prev_ids.clear();
        self.prev_path.clear();
        self.prev_id = 0;
        if self.streams[HEADS].is_empty() {
            return Streams::default();
        }
        Streams::join(&[], &mut self.streams)
    }
}

/// One stack's head (version 5): its id (a zigzag delta from the previous stack's), its
/// process and whether it was cut.
fn read_head(heads: &mut Cursor<'_>, prev_id: u32) -> Result<(u32, u32, bool), FormatError> {
    let id = i64::from(prev_id) + heads.signed()?;
    let id = u32::try_from(id).map_err(|_| heads.error("stack id out of range"))?;
    let pid = heads.varint_u32()?;
    let truncated = heads.varint()? & 1 != 0;
    Ok((id, pid, truncated))
}

/// The stacks of a version-5 (or later) `Stacks` chunk without their frames: ids, processes
/// and cuts, read from the heads stream alone (what `record`'s end-of-run warnings need;
/// decoding every stack's frames took most of that pass on a Python program's recording).
pub fn parse_heads(payload: &[u8], offset: u64) -> Result<Vec<FileStack>, FormatError> {
    let mut st: [Cursor<'_>; STREAMS] = Cursor::new(payload, offset).streams()?;
    let mut out = Vec::new();
    let mut prev_id = 0u32;
    while !st[HEADS].is_empty() {
        let (id, pid, truncated) = read_head(&mut st[HEADS], prev_id)?;
        prev_id = id;
        out.push(FileStack { id, pid, kernel: Vec::new(), user: Vec::new(), truncated });
    }
    Ok(out)
}

/// Decodes a version-5 `Stacks` chunk.
pub fn parse_columns(payload: &[u8], offset: u64) -> Result<Vec<FileStack>, FormatError> {
    let mut st: [Cursor<'_>; STREAMS] = Cursor::new(payload, offset).streams()?;
    let mut nodes = Nodes::default();
    let mut siblings = Siblings::default();
    // The nodes of the previous stack, outermost first.
    let mut path: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    let mut prev_id = 0u32;
    while !st[HEADS].is_empty() {
        let (id, pid, truncated) = read_head(&mut st[HEADS], prev_id)?;
        prev_id = id;
        let reference = st[SHARED].varint()?;
        if reference & 1 == 1 {
            let pop = usize::try_from(reference / 2).unwrap_or(usize::MAX);
            if pop > path.len() {
                return Err(st[SHARED].error("stack shares more frames than the previous one has"));
            }
            path.truncate(path.len() - pop);
        } else if reference == 0 {
            path.clear();
        } else {
            let back = reference / 2;
            let len = nodes.len() as u64;
            if back > len {
                return Err(st[SHARED].error("stack node out of range"));
            }
            nodes.path_to((len + 1 - back) as u32, &mut path);
        }
        let mut node = path.last().copied().unwrap_or(0);
        let new = st[COUNTS].varint()?;
        // Each new frame takes at least its kind byte.
        if new > st[KINDS].rest().len() as u64 {
            return Err(st[COUNTS].error("more frames than the chunk holds"));
        }
        for _ in 0..new {
            let kind = st[KINDS].varint()?;
            let f = match kind {
                0 => Frame::User(FileFrame::Address(st[ADDRS].varint()?)),
                1 => Frame::Kernel(!st[KERNEL].varint()?),
                _ => {
                    let module = u32::try_from(kind - 2).map_err(|_| st[KINDS].error("module id out of range"))?;
                    let offset = siblings.decode(node, module, st[OFFSETS].varint()?);
                    Frame::User(FileFrame::Module { module, offset })
                }
            };
            node = nodes.add(node, f, &st[KINDS])?;
            path.push(node);
        }
        out.push(nodes.stack(node, id, pid, truncated));
    }
    if st.iter().any(|c| !c.is_empty()) {
        return Err(st[HEADS].error("bytes after the last stack"));
    }
    Ok(out)
}

/// A decoded tree: node n - 1 is (parent, frame, depth).
#[derive(Default)]
struct Nodes(Vec<(u32, Frame, u32)>);

impl Nodes {
    fn len(&self) -> usize {
        self.0.len()
    }

    /// Adds `f` under `node` (checked to exist); the new node.
    fn add(&mut self, node: u32, f: Frame, c: &Cursor<'_>) -> Result<u32, FormatError> {
        let depth = match node {
            0 => 1,
            n => self.0.get(n as usize - 1).ok_or_else(|| c.error("stack node out of range"))?.2 + 1,
        };
        if depth > MAX_DECODED_FRAMES {
            return Err(c.error("stack deeper than any walk"));
        }
        self.0.push((node, f, depth));
        Ok(self.0.len() as u32)
    }

    /// The nodes from the root to `node` (which exists), outermost first, into `path`.
    fn path_to(&self, mut node: u32, path: &mut Vec<u32>) {
        path.clear();
        while node != 0 {
            path.push(node);
            node = self.0[node as usize - 1].0;
        }
        path.reverse();
    }

    /// The stack ending at `node`, its frames innermost first.
    fn stack(&self, mut node: u32, id: u32, pid: u32, truncated: bool) -> FileStack {
        // Counted first: a reader holds every stack of a recording (a million of them in a
        // heavy program's), and vectors grown a frame at a time kept a third more room.
        let (mut kernels, mut users, mut n) = (0, 0, node);
        while n != 0 {
            let (parent, f, _) = self.0[n as usize - 1];
            match f {
                Frame::Kernel(_) => kernels += 1,
                Frame::User(_) => users += 1,
            }
            n = parent;
        }
        let (mut kernel, mut user) = (Vec::with_capacity(kernels), Vec::with_capacity(users));
        while node != 0 {
            let (parent, f, _) = self.0[node as usize - 1];
            match f {
                Frame::Kernel(a) => kernel.push(a),
                Frame::User(f) => user.push(f),
            }
            node = parent;
        }
        FileStack { id, pid, kernel, user, truncated }
    }
}

/// Encodes a version-4 `Stacks` chunk (for the tests that make older recordings).
#[cfg(test)]
pub fn encode_tree_rows(stacks: &[FileStack]) -> Vec<u8> {
    let (mut tree, mut path, mut out) = (Tree::default(), Vec::new(), Vec::new());
    for s in stacks {
        outermost_first(s, &mut path);
        let mut ids = Vec::new();
        tree.shared(&path, &[], &[], &mut ids);
        let (mut node, shared) = (ids.last().copied().unwrap_or(0), ids.len());
        for v in [u64::from(s.id), u64::from(s.pid), u64::from(s.truncated), u64::from(node)] {
            put_varint(&mut out, v);
        }
        put_varint(&mut out, (path.len() - shared) as u64);
        for &f in &path[shared..] {
            put_frame(&mut out, f);
            node = tree.add(node, f);
        }
    }
    out
}

/// Decodes a version-4 `Stacks` chunk.
pub fn parse_tree(payload: &[u8], offset: u64) -> Result<Vec<FileStack>, FormatError> {
    let mut c = Cursor::new(payload, offset);
    let mut nodes = Nodes::default();
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
            node = nodes.add(node, f, &c)?;
        }
        out.push(nodes.stack(node, id, pid, truncated));
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
