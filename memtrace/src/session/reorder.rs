//! Merging the per-CPU streams into one time order. Each ring is nearly sorted, but events
//! of different CPUs interleave, and a realloc's free carries the time realloc was entered;
//! so events wait here until no earlier one can still arrive.
//!
//! Waiting events are filed by time into buckets of [`BUCKET_NS`]; a bucket is sorted once,
//! when it is released. (A binary heap of every waiting event was a fifth of the recorder's
//! CPU time: ~40,000 events wait at 400,000 events/s, and each pop walked 15 levels of it.)
use std::collections::VecDeque;

use crate::event::Event;

/// The span of time of one bucket: about a millisecond.
const BUCKET_NS: u64 = 1 << 20;

/// (time, arrival, slot): arrival keeps events of one time in the order they came.
type Key = (u64, u64, u32);

#[derive(Default)]
struct Bucket {
    /// `time / BUCKET_NS` of its events.
    id: u64,
    keys: Vec<Key>,
    /// Whether `keys` is in order (nothing came since the last release sorted it).
    sorted: bool,
}

/// Slots per chunk of [`Slots`] (320 KiB).
const SLOT_CHUNK: usize = 4096;

/// Waiting events by slot, in chunks that never move. A vector of every slot doubled as a
/// burst grew: PyTorch's 148k waiting events took 21 MB of it, 31 MB while it doubled;
/// chunks hold what the most events waiting at once took.
#[derive(Default)]
struct Slots {
    chunks: Vec<Box<[Option<Event>]>>,
    /// Slots given out since the last `clear`.
    len: usize,
}

impl Slots {
    /// Puts `event` in a new slot; its number.
    fn push(&mut self, event: Event) -> u32 {
        let (chunk, at) = (self.len / SLOT_CHUNK, self.len % SLOT_CHUNK);
        if chunk == self.chunks.len() {
            self.chunks.push((0..SLOT_CHUNK).map(|_| None).collect());
        }
        self.chunks[chunk][at] = Some(event);
        self.len += 1;
        (self.len - 1) as u32
    }

    fn get_mut(&mut self, slot: u32) -> &mut Option<Event> {
        let slot = slot as usize;
        &mut self.chunks[slot / SLOT_CHUNK][slot % SLOT_CHUNK]
    }

    /// Forgets every slot (all empty), keeping at most `keep` chunks for the next ones.
    fn clear(&mut self, keep: usize) {
        self.len = 0;
        self.chunks.truncate(keep);
    }
}

/// Events wait in `slots`; the buckets hold small keys, so sorting moves 24-byte keys rather
/// than whole events.
#[derive(Default)]
pub struct Reorder {
    /// By `id`, oldest first; only buckets holding events.
    buckets: VecDeque<Bucket>,
    /// Emptied buckets' vectors, reused.
    spare: Vec<Vec<Key>>,
    held: usize,
    /// The most events held at once so far.
    most: usize,
    slots: Slots,
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
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// The most events held at once so far.
    pub fn most_held(&self) -> usize {
        self.most
    }

    pub fn push(&mut self, event: Event) {
        let ts = event.ts_ns();
        if ts < self.released_up_to {
            self.late += 1;
        }
        self.seq += 1;
        let slot = match self.free.pop() {
            Some(slot) => {
                *self.slots.get_mut(slot) = Some(event);
                slot
            }
            None => self.slots.push(event),
        };
        self.held += 1;
        self.most = self.most.max(self.held);
        let id = ts / BUCKET_NS;
        // Nearly always the newest bucket, or one just before it.
        let at = self.buckets.iter().rposition(|b| b.id <= id);
        let index = match at {
            Some(i) if self.buckets[i].id == id => i,
            _ => {
                let i = at.map_or(0, |i| i + 1);
                let keys = self.spare.pop().unwrap_or_default();
                self.buckets.insert(i, Bucket { id, keys, sorted: true });
                i
            }
        };
        let bucket = &mut self.buckets[index];
        if bucket.keys.last().is_some_and(|last| last.0 > ts) {
            bucket.sorted = false;
        }
        bucket.keys.push((ts, self.seq, slot));
    }

    /// Releases, in time order, every event stamped before `watermark`.
    pub fn release(&mut self, watermark: u64, sink: &mut dyn FnMut(Event)) {
        self.release_while(sink, |ts, _| ts < watermark);
    }

    /// Releases the `count` oldest events, whatever their time (the buffer is full).
    pub fn release_oldest(&mut self, count: usize, sink: &mut dyn FnMut(Event)) {
        self.release_while(sink, |_, n| n < count);
    }

    pub fn release_all(&mut self, sink: &mut dyn FnMut(Event)) {
        self.release(u64::MAX, sink);
    }

    /// Releases the oldest events while `more(time, released so far)` holds.
    fn release_while(&mut self, sink: &mut dyn FnMut(Event), more: impl Fn(u64, usize) -> bool) {
        let mut n = 0;
        while let Some(bucket) = self.buckets.front_mut() {
            if !more(bucket.id.saturating_mul(BUCKET_NS), n) {
                break;
            }
            if !bucket.sorted {
                bucket.keys.sort_unstable();
                bucket.sorted = true;
            }
            let mut released = 0;
            for &(ts, _, slot) in &bucket.keys {
                if !more(ts, n) {
                    break;
                }
                self.released_up_to = self.released_up_to.max(ts);
                self.free.push(slot);
                if let Some(event) = self.slots.get_mut(slot).take() {
                    sink(event);
                }
                n += 1;
                released += 1;
            }
            self.held -= released;
            if released == bucket.keys.len() {
                let mut keys = std::mem::take(&mut bucket.keys);
                self.buckets.pop_front();
                keys.clear();
                if self.spare.len() < 64 {
                    self.spare.push(keys);
                }
            } else {
                bucket.keys.drain(..released);
                break;
            }
        }
        self.shrink();
    }

    /// Gives back the slots of a burst once it has drained.
    fn shrink(&mut self) {
        if self.held == 0 {
            self.slots.clear((1 << 16) / SLOT_CHUNK);
            self.free.clear();
            if self.free.capacity() > 1 << 16 {
                self.free.shrink_to(1 << 16);
            }
        }
    }
}

/// The time before which every event has arrived, `lag` (the most a record may take to
/// reach its ring once stamped, and how far a ring's own records may be out of order) before
/// now, and before the last event read from each ring left with more (`behind`): a ring not
/// read dry still holds records, older than other rings' last ones when the reader fell
/// behind (stopped, or descheduled by a busy machine) and each ring was read a batch at a
/// time.
pub fn watermark(now: u64, lag: u64, behind: impl IntoIterator<Item = u64>) -> u64 {
    behind.into_iter().fold(now, u64::min).saturating_sub(lag)
}

/// How far the rings read next in a drain are read (`up_to`), once a ring was left with
/// records after its last event at `last`: no further than `lag` past it (a ring read
/// ahead of another only waits in memory for it).
pub fn read_up_to(up_to: Option<u64>, last: u64, lag: u64) -> Option<u64> {
    let this = last.saturating_add(lag);
    Some(up_to.map_or(this, |u| u.min(this)))
}

/// How far task and mapping records (forks, execs, exits, mmaps) are handled in a drain
/// that began at `now`: up to the last record read from each ring left with more
/// (`behind`), past which another drain may still read older ones from such a ring, and
/// up to `now` (a ring read dry early in the drain may have older records by the time a
/// later ring is read). A fork of a shell read after its child's exec and exit (the
/// shell's CPU's ring lagging another's by up to the read-ahead) gave the child no space
/// to walk its stacks from before the exec in: all 17 cut short at a first frame
/// `[unknown]`.
pub fn handled_up_to(now: u64, behind: &[u64]) -> u64 {
    behind.iter().copied().fold(now, u64::min)
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
    fn events_across_buckets_and_out_of_order_within_one_come_out_sorted() {
        let mut r = Reorder::new();
        let times: Vec<u64> = (0..2000u64).map(|i| (i * 7919) % 5000 * 1000 + 3 * BUCKET_NS).collect();
        for &ts in &times {
            r.push(ev(ts));
        }
        assert_eq!(r.len(), 2000);
        let mut out = Vec::new();
        let half = 3 * BUCKET_NS + 2_500_000;
        r.release(half, &mut |e| out.push(e.ts_ns()));
        assert!(out.iter().all(|&t| t < half) && out.is_sorted());
        assert_eq!(out.len(), times.iter().filter(|&&t| t < half).count());
        // Pushed into the partly released bucket after its first release.
        r.push(ev(half + 1));
        r.push(ev(half));
        r.release_oldest(3, &mut |e| out.push(e.ts_ns()));
        r.release_all(&mut |e| out.push(e.ts_ns()));
        assert!(out.is_sorted(), "in time order");
        assert_eq!(out.len(), 2002);
        assert!(r.is_empty() && r.late == 0);
    }

    #[test]
    fn release_oldest_takes_exactly_that_many() {
        let mut r = Reorder::new();
        for ts in [5 * BUCKET_NS, 1, 2 * BUCKET_NS, 3] {
            r.push(ev(ts));
        }
        let mut out = Vec::new();
        r.release_oldest(3, &mut |e| out.push(e.ts_ns()));
        assert_eq!(out, [1, 3, 2 * BUCKET_NS]);
        assert_eq!(r.len(), 1);
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

    /// Slots past the first chunks, reused after a release and after the buffer emptied.
    #[test]
    fn events_in_many_slot_chunks_come_out_sorted_and_whole() {
        let mut r = Reorder::new();
        let n = 3 * SLOT_CHUNK as u64 + 5;
        let times: Vec<u64> = (0..n).map(|i| (i * 7919) % n * 1000).collect();
        for &ts in &times {
            r.push(ev(ts));
        }
        assert_eq!(r.slots.chunks.len(), 4);
        let mut out = Vec::new();
        r.release(n * 500, &mut |e| out.push(e.ts_ns()));
        let released = out.len();
        // Freed slots are taken again before new ones.
        for ts in 0..SLOT_CHUNK as u64 {
            r.push(ev(n * 1000 + ts));
        }
        assert_eq!(r.slots.chunks.len(), 4);
        r.release_all(&mut |e| out.push(e.ts_ns()));
        let mut want = times.clone();
        want.extend((0..SLOT_CHUNK as u64).map(|ts| n * 1000 + ts));
        want.sort_unstable();
        assert_eq!(out, want);
        assert!(released > 0 && released < n as usize);
        assert!(r.is_empty());
        // Emptied: the chunks past the kept ones are given back, and slots start again.
        assert!(r.slots.chunks.len() <= (1 << 16) / SLOT_CHUNK);
        r.push(ev(1));
        r.release_all(&mut |e| out.push(e.ts_ns()));
        assert_eq!(out.last(), Some(&1));
    }

    #[test]
    fn a_ring_left_with_records_holds_the_watermark_at_its_last_event() {
        let ms = 1_000_000;
        assert_eq!(watermark(1_000 * ms, 100 * ms, []), 900 * ms);
        // A ring read dry only to its batch, last event at 300 ms: nothing after 200 ms
        // goes out, whatever the other rings read.
        assert_eq!(watermark(1_000 * ms, 100 * ms, [300 * ms, 700 * ms]), 200 * ms);
        // A ring behind that has not sent an event yet holds everything.
        assert_eq!(watermark(1_000 * ms, 100 * ms, [0]), 0);
        // Later than now (a clock read before the drain): now rules.
        assert_eq!(watermark(1_000 * ms, 100 * ms, [2_000 * ms]), 900 * ms);
    }

    #[test]
    fn rings_are_read_no_further_than_the_lag_past_the_one_behind() {
        let ms = 1_000_000;
        assert_eq!(read_up_to(None, 300 * ms, 100 * ms), Some(400 * ms));
        assert_eq!(read_up_to(Some(250 * ms), 300 * ms, 100 * ms), Some(250 * ms));
        assert_eq!(read_up_to(Some(900 * ms), 300 * ms, 100 * ms), Some(400 * ms));
    }

    #[test]
    fn task_records_are_handled_up_to_the_ring_furthest_behind() {
        // Every ring read dry: all of them up to when the drain began.
        assert_eq!(handled_up_to(1_000, &[]), 1_000);
        // A ring left with records after 300: what came after in other rings waits.
        assert_eq!(handled_up_to(1_000, &[700, 300]), 300);
    }
}
