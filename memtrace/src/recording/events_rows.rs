//! The `Events` chunk of format versions 2 and 3, one event after another (version 4 keeps
//! each field in a stream of its own; both write and read an event with the code of
//! `events`, whose fields here all go to one buffer). Read for older recordings; the
//! encoder is kept for the tests that make such recordings. Each chunk starts from a clean
//! state (base timestamp, empty task and call-site tables, zero pointer deltas).
//!
//! Per event: a tag byte (bits 0-5: the event code, a `Kind` or 48 + a task event; bit 6:
//! a flags byte follows; bit 7: same task as the previous event), the zigzag timestamp
//! delta, the task reference unless bit 7 (an index into the chunk's task table; the
//! table's length means "new: pid, tid follow"), then the body of the kind. A user
//! allocation whose allocator is known has bit 6 of its flags byte set and the allocator's
//! index byte after its body (format version 2).
use super::{
    FormatError,
    codec::Cursor,
    events::{DecodeState, decode_event},
};
use crate::event::Event;

/// Encodes a version 2–3 `Events` chunk (for the tests that make older recordings).
#[cfg(test)]
pub struct EventEncoder {
    buf: Vec<u8>,
    count: u32,
    base_ts: u64,
    prev_ts: u64,
    state: super::events::EncodeState,
}

#[cfg(test)]
impl EventEncoder {
    pub fn new() -> Self {
        Self { buf: Vec::new(), count: 0, base_ts: 0, prev_ts: 0, state: Default::default() }
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
            self.prev_ts = self.base_ts;
        }
        self.count += 1;
        let delta = event.ts_ns().wrapping_sub(self.prev_ts) as i64;
        super::events::encode_event(&mut self.buf, &mut self.state, event, delta);
        self.prev_ts = event.ts_ns();
    }
}

/// Decodes a whole version 2–3 `Events` chunk payload, calling `sink` per event.
pub fn decode_rows(payload: &[u8], base: u64, sink: &mut dyn FnMut(Event)) -> Result<u32, FormatError> {
    let mut c = Cursor::new(payload, base);
    let base_ts = c.u64_le()?;
    let count = c.u32_le()?;
    let mut st = DecodeState::default();
    let mut prev_ts = base_ts;
    for _ in 0..count {
        let event = decode_event(&mut c, &mut st, base, |delta| {
            prev_ts = prev_ts.wrapping_add(delta as u64);
            prev_ts
        })?;
        sink(event);
    }
    if !c.is_empty() {
        return Err(FormatError::Corrupt { offset: base, reason: "bytes after the last event".into() });
    }
    Ok(count)
}
