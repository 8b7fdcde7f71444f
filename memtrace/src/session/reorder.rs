//! Merging the per-CPU streams into one time order. Each ring is nearly sorted, but events
//! of different CPUs interleave, and a realloc's free carries the time realloc was entered;
//! so events wait here until no earlier one can still arrive.
use std::{cmp::Reverse, collections::BinaryHeap};

use crate::event::Event;

/// Events wait in `slots`; the heap orders small keys (time, arrival, slot), so a push or
/// a pop moves 24-byte keys rather than whole events.
#[derive(Default)]
pub struct Reorder {
    heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    slots: Vec<Option<Event>>,
    free: Vec<u32>,
    seq: u64,
    released_up_to: u64,
    /// Events that arrived after a later one had been released (written out of order).
    pub late: u64,
}

impl Reorder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    pub fn push(&mut self, event: Event) {
        let ts = event.ts_ns();
        if ts < self.released_up_to {
            self.late += 1;
        }
        self.seq += 1;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(event);
                slot
            }
            None => {
                self.slots.push(Some(event));
                (self.slots.len() - 1) as u32
            }
        };
        self.heap.push(Reverse((ts, self.seq, slot)));
    }

    /// The oldest event, out of the buffer.
    fn pop(&mut self) -> Option<Event> {
        let Reverse((ts, _, slot)) = self.heap.pop()?;
        self.released_up_to = self.released_up_to.max(ts);
        self.free.push(slot);
        self.slots[slot as usize].take()
    }

    /// Releases, in time order, every event stamped before `watermark`.
    pub fn release(&mut self, watermark: u64, sink: &mut dyn FnMut(Event)) {
        while let Some(Reverse((ts, _, _))) = self.heap.peek() {
            if *ts >= watermark {
                break;
            }
            if let Some(event) = self.pop() {
                sink(event);
            }
        }
        self.shrink();
    }

    /// Releases the `count` oldest events, whatever their time (the buffer is full).
    pub fn release_oldest(&mut self, count: usize, sink: &mut dyn FnMut(Event)) {
        for _ in 0..count {
            if self.heap.is_empty() {
                break;
            }
            if let Some(event) = self.pop() {
                sink(event);
            }
        }
        self.shrink();
    }

    pub fn release_all(&mut self, sink: &mut dyn FnMut(Event)) {
        self.release(u64::MAX, sink);
    }

    /// Gives back the slots of a burst once it has drained.
    fn shrink(&mut self) {
        if self.heap.is_empty() {
            self.slots.clear();
            self.free.clear();
            if self.slots.capacity() > 1 << 16 {
                self.slots.shrink_to(1 << 16);
                self.free.shrink_to(1 << 16);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::Kind;

    use super::*;
    use crate::event::Free;

    fn ev(ts: u64) -> Event {
        Event::Free(Free { ts_ns: ts, pid: 1, tid: 1, cpu: 0, kind: Kind::Free, flags: 0, ptr: ts, arg: 0 })
    }

    #[test]
    fn releases_in_time_order_up_to_the_watermark() {
        let mut r = Reorder::new();
        for ts in [30, 10, 20, 50, 40] {
            r.push(ev(ts));
        }
        let mut out = Vec::new();
        r.release(35, &mut |e| out.push(e.ts_ns()));
        assert_eq!(out, [10, 20, 30]);
        r.push(ev(25)); // late: 30 was already released
        assert_eq!(r.late, 1);
        r.release_all(&mut |e| out.push(e.ts_ns()));
        assert_eq!(out, [10, 20, 30, 25, 40, 50]);
        assert!(r.is_empty());
    }

    #[test]
    fn equal_timestamps_keep_arrival_order() {
        let mut r = Reorder::new();
        for ptr in [3, 1, 2] {
            r.push(Event::Free(Free { ts_ns: 5, pid: 1, tid: 1, cpu: 0, kind: Kind::Free, flags: 0, ptr, arg: 0 }));
        }
        let mut out = Vec::new();
        r.release_all(&mut |e| {
            if let Event::Free(f) = e {
                out.push(f.ptr)
            }
        });
        assert_eq!(out, [3, 1, 2]);
    }
}
