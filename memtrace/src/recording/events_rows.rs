//! The `Events` chunk of format versions 2 and 3, one event after another (version 4 keeps
//! each field in a stream of its own: `events`). Read for older recordings; the encoder is
//! kept for the tests that make such recordings. Each chunk starts from a clean state (base
//! timestamp, empty task and call-site tables, zero pointer deltas).
//!
//! Per event: a tag byte (bits 0-5: the event code, a `Kind` or 48 + a task event; bit 6:
//! a flags byte follows; bit 7: same task as the previous event), the zigzag timestamp
//! delta, the task reference unless bit 7 (an index into the chunk's task table; the
//! table's length means "new: pid, tid follow"), then the body of the kind. A user
//! allocation whose allocator is known has bit 6 of its flags byte set and the allocator's
//! index byte after its body (format version 2).
#[cfg(test)]
use std::collections::HashMap;

use memtrace_common::{Kind, TaskEvent};

#[cfg(test)]
use super::codec::{put_signed, put_str, put_varint};
use super::{FormatError, codec::Cursor};
use crate::event::{Alloc, Event, Free, Task};

const TASK_CODE_BASE: u8 = 48;
const HAS_FLAGS: u8 = 1 << 6;
const SAME_TASK: u8 = 1 << 7;
const CODE_MASK: u8 = 0x3f;
/// In the flags byte of a user allocation: the allocator's index follows the body (no
/// `memtrace_common::flags` bit uses it; a test checks).
pub(super) const ALLOCATOR_FOLLOWS: u8 = 1 << 6;

#[derive(Default)]
struct State {
    prev_ts: u64,
    prev_task: Option<(u32, u32)>,
    tasks: Vec<(u32, u32)>,
    call_sites: Vec<u64>,
    prev_ptr: [u64; 8],
    /// Encoder only: reverse indexes of the two tables.
    #[cfg(test)]
    task_index: HashMap<(u32, u32), u64>,
    #[cfg(test)]
    call_site_index: HashMap<u64, u64>,
}

impl State {
    fn new(base_ts: u64) -> Self {
        Self { prev_ts: base_ts, ..Default::default() }
    }
}

fn space_index(kind: Kind) -> usize {
    kind.space() as usize
}

#[cfg(test)]
pub struct EventEncoder {
    pub buf: Vec<u8>,
    pub count: u32,
    state: State,
    base_ts: u64,
}

#[cfg(test)]
impl EventEncoder {
    pub fn new() -> Self {
        Self { buf: Vec::with_capacity(64 << 10), count: 0, state: State::new(0), base_ts: 0 }
    }

    /// Payload of the chunk so far: base timestamp, count, events.
    pub fn payload(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.buf.len() + 12);
        out.extend_from_slice(&self.base_ts.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.buf);
        out
    }

    pub fn push(&mut self, event: &Event) {
        if self.count == 0 {
            self.base_ts = event.ts_ns();
            self.state = State::new(self.base_ts);
        }
        self.count += 1;
        let (code, flags, pid, tid) = match event {
            Event::Alloc(a) if a.allocator != 0 && !a.kind.is_kernel() => {
                (a.kind as u8, a.flags | ALLOCATOR_FOLLOWS, a.pid, a.tid)
            }
            Event::Alloc(a) => (a.kind as u8, a.flags, a.pid, a.tid),
            Event::Free(f) => (f.kind as u8, f.flags, f.pid, f.tid),
            Event::Task(t) => (TASK_CODE_BASE + t.event as u8, t.flags, t.pid, t.tid),
        };
        let st = &mut self.state;
        let same_task = st.prev_task == Some((pid, tid));
        let mut tag = code;
        if flags != 0 {
            tag |= HAS_FLAGS;
        }
        if same_task {
            tag |= SAME_TASK;
        }
        let buf = &mut self.buf;
        buf.push(tag);
        put_signed(buf, event.ts_ns().wrapping_sub(st.prev_ts) as i64);
        st.prev_ts = event.ts_ns();
        if !same_task {
            match st.task_index.get(&(pid, tid)) {
                Some(&i) => put_varint(buf, i),
                None => {
                    let i = st.task_index.len() as u64;
                    put_varint(buf, i);
                    put_varint(buf, u64::from(pid));
                    put_varint(buf, u64::from(tid));
                    st.task_index.insert((pid, tid), i);
                }
            }
            st.prev_task = Some((pid, tid));
        }
        if flags != 0 {
            buf.push(flags);
        }
        match event {
            Event::Alloc(a) => {
                let space = space_index(a.kind);
                if a.kind.is_kernel() {
                    put_varint(buf, u64::from(a.cpu));
                }
                put_signed(buf, a.ptr.wrapping_sub(st.prev_ptr[space]) as i64);
                st.prev_ptr[space] = a.ptr;
                put_varint(buf, a.bytes_req);
                put_signed(buf, a.bytes_alloc.wrapping_sub(a.bytes_req) as i64);
                put_varint(buf, a.stack);
                if a.kind.is_kernel() {
                    match st.call_site_index.get(&a.call_site) {
                        Some(&i) => put_varint(buf, i),
                        None => {
                            let i = st.call_site_index.len() as u64;
                            put_varint(buf, i);
                            put_varint(buf, a.call_site);
                            st.call_site_index.insert(a.call_site, i);
                        }
                    }
                    put_varint(buf, u64::from(a.gfp_flags));
                    put_signed(buf, i64::from(a.node));
                    buf.push(a.order);
                } else {
                    if a.kind.is_gpu() {
                        // The device ordinal (-1: not known).
                        put_signed(buf, i64::from(a.node));
                    }
                    if a.allocator != 0 {
                        buf.push(a.allocator);
                    }
                }
            }
            Event::Free(f) => {
                let space = space_index(f.kind);
                if f.kind.is_kernel() {
                    put_varint(buf, u64::from(f.cpu));
                }
                put_signed(buf, f.ptr.wrapping_sub(st.prev_ptr[space]) as i64);
                st.prev_ptr[space] = f.ptr;
                put_varint(buf, u64::from(f.arg));
            }
            Event::Task(t) => {
                put_varint(buf, u64::from(t.ppid));
                put_str(buf, &t.comm);
                put_str(buf, &t.filename);
            }
        }
    }
}

/// Decodes a whole version 2–3 `Events` chunk payload, calling `sink` per event.
pub fn decode_rows(payload: &[u8], base: u64, sink: &mut dyn FnMut(Event)) -> Result<u32, FormatError> {
    let mut c = Cursor::new(payload, base);
    let base_ts = c.u64_le()?;
    let count = c.u32_le()?;
    let mut st = State::new(base_ts);
    for _ in 0..count {
        let tag = c.u8()?;
        let code = tag & CODE_MASK;
        let ts = st.prev_ts.wrapping_add(c.signed()? as u64);
        st.prev_ts = ts;
        let (pid, tid) = if tag & SAME_TASK != 0 {
            st.prev_task.ok_or_else(|| corrupt(&c, base, "same-task flag on the first event"))?
        } else {
            let i = c.varint()? as usize;
            if i == st.tasks.len() {
                let pid = c.varint_u32()?;
                let tid = c.varint_u32()?;
                st.tasks.push((pid, tid));
            }
            *st.tasks.get(i).ok_or_else(|| corrupt(&c, base, "task reference out of range"))?
        };
        st.prev_task = Some((pid, tid));
        let flags = if tag & HAS_FLAGS != 0 { c.u8()? } else { 0 };
        let event = if code >= TASK_CODE_BASE {
            let event =
                TaskEvent::from_u8(code - TASK_CODE_BASE).ok_or_else(|| corrupt(&c, base, "unknown task event"))?;
            Event::Task(Task {
                ts_ns: ts,
                event,
                flags,
                pid,
                tid,
                ppid: c.varint_u32()?,
                comm: c.string()?,
                filename: c.string()?,
            })
        } else {
            let kind = Kind::from_u8(code).ok_or_else(|| corrupt(&c, base, "unknown event kind"))?;
            let space = space_index(kind);
            let cpu = if kind.is_kernel() { c.varint()? as u16 } else { 0 };
            let ptr = st.prev_ptr[space].wrapping_add(c.signed()? as u64);
            st.prev_ptr[space] = ptr;
            if kind.is_free() {
                Event::Free(Free { ts_ns: ts, pid, tid, cpu, kind, flags, ptr, arg: c.varint_u32()? })
            } else {
                let bytes_req = c.varint()?;
                let bytes_alloc = bytes_req.wrapping_add(c.signed()? as u64);
                let stack = c.varint()?;
                let (call_site, gfp_flags, node, order) = if kind.is_kernel() {
                    let i = c.varint()? as usize;
                    if i == st.call_sites.len() {
                        let site = c.varint()?;
                        st.call_sites.push(site);
                    }
                    let site =
                        *st.call_sites.get(i).ok_or_else(|| corrupt(&c, base, "call-site reference out of range"))?;
                    let gfp = c.varint_u32()?;
                    let node = i32::try_from(c.signed()?).map_err(|_| corrupt(&c, base, "node out of range"))?;
                    (site, gfp, node, c.u8()?)
                } else if kind.is_gpu() {
                    let node = i32::try_from(c.signed()?).map_err(|_| corrupt(&c, base, "device out of range"))?;
                    (0, 0, node, 0)
                } else {
                    (0, 0, -1, 0)
                };
                let allocator = if !kind.is_kernel() && flags & ALLOCATOR_FOLLOWS != 0 { c.u8()? } else { 0 };
                let flags = if kind.is_kernel() { flags } else { flags & !ALLOCATOR_FOLLOWS };
                Event::Alloc(Alloc {
                    ts_ns: ts,
                    pid,
                    tid,
                    cpu,
                    kind,
                    flags,
                    ptr,
                    bytes_req,
                    bytes_alloc,
                    stack,
                    call_site,
                    gfp_flags,
                    node,
                    order,
                    allocator,
                })
            }
        };
        sink(event);
    }
    if !c.is_empty() {
        return Err(corrupt(&c, base, "bytes after the last event"));
    }
    Ok(count)
}

fn corrupt(_c: &Cursor<'_>, base: u64, reason: &str) -> FormatError {
    FormatError::Corrupt { offset: base, reason: reason.to_string() }
}
