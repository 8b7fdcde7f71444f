//! Reading a BPF ring buffer from one mapping of its data.
//!
//! The kernel maps a ring's data pages twice, one copy after the other, so that a record
//! running across the end reads as one piece; a reader that maps them that way (libbpf,
//! aya) has every page in its resident set twice from the moment it maps them (the kernel
//! inserts them all at `mmap`): on a 2-CPU machine 64 MB of `record`'s peak for 32 MiB of
//! rings, 128 MB on 16 CPUs. This reader maps the data once and copies the few records
//! that run across the end into a buffer of its own.
//!
//! The protocol (kernel/bpf/ringbuf.c): page 0 holds the consumer position (the only page
//! user space may write), page 1 the producer position, then the data. A record is an
//! 8-byte header (length with a busy and a discard bit, then the page offset the kernel
//! uses) and its bytes, padded to 8; positions only grow, the offset is `pos & (size - 1)`.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{self, AtomicU32, AtomicUsize, Ordering};

use anyhow::{Context, Result, bail};
use aya::maps::MapData;

const BUSY_BIT: u32 = 1 << 31;
const DISCARD_BIT: u32 = 1 << 30;
const HEADER_BYTES: usize = 8;

/// A shared mapping, unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(fd: RawFd, len: usize, prot: libc::c_int, offset: usize) -> Result<Self> {
        let offset = libc::off_t::try_from(offset).context("ring mapping offset")?;
        // SAFETY: a fresh mapping chosen by the kernel (no address given): it overlaps
        // nothing of ours; the result is checked before use.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, offset) };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping a ring buffer");
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).context("mapping a ring buffer: null address")?;
        Ok(Self { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned and nothing borrows from the
        // mapping past its owner's lifetime.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A CPU's ring, read in order.
pub struct RingReader {
    /// Keeps the map (and its descriptor, for epoll) alive.
    map: Option<MapData>,
    /// Page 0 (the consumer position), then page 1 (the producer position) and the data
    /// once.
    _mappings: Vec<Mapping>,
    consumer_pos: NonNull<AtomicUsize>,
    producer_pos: NonNull<AtomicUsize>,
    data: NonNull<u8>,
    size: usize,
    /// Our position (what the consumer page says, once a record is read).
    pos: usize,
    /// The producer position last read.
    seen_producer: usize,
    /// A record was consumed since the producer position was last read: the kernel may
    /// have seen the ring as caught up and not woken us (see `available`).
    needs_fence: bool,
    /// A record that ran across the end, put back together.
    joined: Vec<u8>,
    /// Records that ran across the end.
    pub joined_records: u64,
    /// A header no kernel writes was met: the ring is not read further.
    broken: bool,
}

// SAFETY: the pointers are into mappings this reader owns (or, in tests, memory the test
// keeps alive); the kernel is the only other party and is synchronized with atomics.
unsafe impl Send for RingReader {}

impl RingReader {
    /// Maps `map`, a ring buffer of `size` bytes (a power of two, a multiple of the page).
    pub fn new(map: MapData, size: u32) -> Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let size = size as usize;
        if !size.is_power_of_two() || !size.is_multiple_of(page) {
            bail!("a ring buffer of {size} bytes is not a power-of-two number of pages");
        }
        let fd = map.fd().as_fd().as_raw_fd();
        let consumer = Mapping::new(fd, page, libc::PROT_READ | libc::PROT_WRITE, 0)?;
        let producer = Mapping::new(fd, page + size, libc::PROT_READ, page)?;
        // SAFETY: the data starts one page into the producer mapping, which is `page +
        // size` long.
        let data = unsafe { producer.ptr.add(page) };
        let (consumer_pos, producer_pos) = (consumer.ptr.cast(), producer.ptr.cast());
        // SAFETY: both position pages are mapped, page-aligned, and hold an unsigned long
        // the kernel updates atomically; `data` has `size` bytes; all live in `_mappings`.
        Ok(unsafe { Self::from_parts(Some(map), vec![consumer, producer], consumer_pos, producer_pos, data, size) })
    }

    /// # Safety
    /// `consumer_pos` and `producer_pos` point to aligned words and `data` to `size` bytes
    /// (8-aligned, `size` a power of two), all valid for as long as the reader.
    unsafe fn from_parts(
        map: Option<MapData>,
        mappings: Vec<Mapping>,
        consumer_pos: NonNull<AtomicUsize>,
        producer_pos: NonNull<AtomicUsize>,
        data: NonNull<u8>,
        size: usize,
    ) -> Self {
        let mut reader = Self {
            map,
            _mappings: mappings,
            consumer_pos,
            producer_pos,
            data,
            size,
            pos: 0,
            seen_producer: 0,
            needs_fence: false,
            joined: Vec::new(),
            joined_records: 0,
            broken: false,
        };
        reader.pos = reader.consumer_pos().load(Ordering::Acquire);
        reader.seen_producer = reader.producer_pos().load(Ordering::Acquire);
        reader
    }

    fn consumer_pos(&self) -> &AtomicUsize {
        // SAFETY: valid for as long as `self` (see `from_parts`).
        unsafe { self.consumer_pos.as_ref() }
    }

    fn producer_pos(&self) -> &AtomicUsize {
        // SAFETY: as for `consumer_pos`.
        unsafe { self.producer_pos.as_ref() }
    }

    fn data(&self) -> *const u8 {
        self.data.as_ptr()
    }

    /// Bytes written by the probes and not read yet (records and their headers).
    pub fn waiting_bytes(&self) -> u64 {
        let producer = self.producer_pos().load(Ordering::Acquire);
        producer.wrapping_sub(self.consumer_pos().load(Ordering::Acquire)) as u64
    }

    /// The ring's size in bytes.
    pub fn size(&self) -> u64 {
        self.size as u64
    }

    /// Whether a record may wait at our position.
    fn available(&mut self) -> bool {
        if self.pos == self.seen_producer {
            if self.needs_fence {
                // The kernel wakes the reader only when a record is committed at the
                // consumer position it sees: order our store of the position before the
                // load of the producer's, so that either this load sees the new record or
                // the kernel saw our position and sends a wakeup.
                atomic::fence(Ordering::SeqCst);
                self.needs_fence = false;
            }
            self.seen_producer = self.producer_pos().load(Ordering::Acquire);
        }
        // Positions only grow (and wrap at usize::MAX, which equality survives).
        self.pos != self.seen_producer
    }

    fn advance(&mut self, len: usize) {
        self.pos = self.pos.wrapping_add((HEADER_BYTES + len).next_multiple_of(8));
        // The kernel reads it with an acquire before it reuses the record's bytes.
        self.consumer_pos().store(self.pos, Ordering::Release);
        self.needs_fence = true;
    }

    /// Hands the next record to `f` (None: the ring is empty, or its next record is still
    /// being written). Discarded records are stepped over.
    pub fn read<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let mask = self.size - 1;
        while !self.broken && self.available() {
            let offset = self.pos & mask;
            // SAFETY: `offset` is 8-aligned and below `size`, and a header never runs across
            // the end (records are padded to 8 and the size is a multiple of 8).
            let header = unsafe { &*self.data().add(offset).cast::<AtomicU32>() };
            // The kernel commits with a fully ordered exchange: acquire makes the bytes
            // written before it visible.
            let header = header.load(Ordering::Acquire);
            if header & BUSY_BIT != 0 {
                if !self.needs_fence {
                    return None;
                }
                // As in `available`: make sure the kernel sees our position or we see its commit.
                atomic::fence(Ordering::SeqCst);
                self.needs_fence = false;
                continue;
            }
            let len = (header & !(BUSY_BIT | DISCARD_BIT)) as usize;
            if len > self.size - HEADER_BYTES {
                // Not a record the kernel could have written: stop reading this ring rather
                // than read outside it.
                log::warn!("a ring buffer record claims {len} bytes in a ring of {}: ring left unread", self.size);
                self.broken = true;
                return None;
            }
            if header & DISCARD_BIT != 0 {
                self.advance(len);
                continue;
            }
            let start = (offset + HEADER_BYTES) & mask;
            let first = len.min(self.size - start);
            // SAFETY: `start + first <= size`, inside the data mapping; the kernel does not
            // write a record's bytes once committed until the consumer position passes it.
            let head = unsafe { std::slice::from_raw_parts(self.data().add(start), first) };
            let out = if first == len {
                f(head)
            } else {
                self.joined.clear();
                self.joined.extend_from_slice(head);
                // SAFETY: the rest of the record starts the data again; `len - first <
                // size`.
                let tail = unsafe { std::slice::from_raw_parts(self.data(), len - first) };
                self.joined.extend_from_slice(tail);
                self.joined_records += 1;
                f(&self.joined)
            };
            self.advance(len);
            return Some(out);
        }
        None
    }
}

impl AsRawFd for RingReader {
    fn as_raw_fd(&self) -> RawFd {
        self.map.as_ref().map_or(-1, |m| m.fd().as_fd().as_raw_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring in ordinary memory, written the way the kernel writes one.
    struct FakeRing {
        positions: Box<[AtomicUsize; 2]>,
        data: Box<[u64]>,
        produced: usize,
    }

    impl FakeRing {
        fn new(size: usize) -> Self {
            Self {
                positions: Box::new([AtomicUsize::new(0), AtomicUsize::new(0)]),
                data: vec![0u64; size / 8].into_boxed_slice(),
                produced: 0,
            }
        }

        fn start_at(&mut self, pos: usize) {
            self.positions[0].store(pos, Ordering::Relaxed);
            self.positions[1].store(pos, Ordering::Relaxed);
            self.produced = pos;
        }

        fn reader(&mut self) -> RingReader {
            let size = self.data.len() * 8;
            let data = NonNull::new(self.data.as_mut_ptr().cast::<u8>()).unwrap();
            // SAFETY: the test keeps `self` alive past the reader.
            unsafe {
                RingReader::from_parts(
                    None,
                    Vec::new(),
                    NonNull::from(&self.positions[0]),
                    NonNull::from(&self.positions[1]),
                    data,
                    size,
                )
            }
        }

        fn bytes(&mut self) -> &mut [u8] {
            let len = self.data.len() * 8;
            // SAFETY: the words' bytes.
            unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr().cast::<u8>(), len) }
        }

        /// Writes a record (its header with `flags`) and returns its header's offset.
        fn produce(&mut self, payload: &[u8], flags: u32) -> usize {
            let mask = self.data.len() * 8 - 1;
            let at = self.produced & mask;
            let header = (payload.len() as u32 | flags).to_le_bytes();
            self.bytes()[at..at + 4].copy_from_slice(&header);
            for (i, b) in payload.iter().enumerate() {
                self.bytes()[(at + HEADER_BYTES + i) & mask] = *b;
            }
            self.produced += (HEADER_BYTES + payload.len()).next_multiple_of(8);
            self.positions[1].store(self.produced, Ordering::Release);
            at
        }

        fn set_flags(&mut self, at: usize, len: usize, flags: u32) {
            self.bytes()[at..at + 4].copy_from_slice(&(len as u32 | flags).to_le_bytes());
        }

        fn consumer(&self) -> usize {
            self.positions[0].load(Ordering::Relaxed)
        }
    }

    fn next(reader: &mut RingReader) -> Option<Vec<u8>> {
        reader.read(<[u8]>::to_vec)
    }

    #[test]
    fn records_come_in_order_and_the_consumer_position_follows() {
        let mut ring = FakeRing::new(64);
        let mut reader = ring.reader();
        assert_eq!(next(&mut reader), None);
        ring.produce(b"hello", 0);
        ring.produce(&[7; 20], 0);
        assert_eq!(next(&mut reader).as_deref(), Some(&b"hello"[..]));
        assert_eq!(ring.consumer(), 16);
        assert_eq!(next(&mut reader), Some(vec![7; 20]));
        assert_eq!(ring.consumer(), 16 + 32);
        assert_eq!(next(&mut reader), None);
        assert_eq!(reader.joined_records, 0);
        assert_eq!((reader.waiting_bytes(), reader.size()), (0, 64));
        ring.produce(b"x", 0);
        assert_eq!(reader.waiting_bytes(), 16);
    }

    #[test]
    fn a_record_across_the_end_is_read_whole() {
        let mut ring = FakeRing::new(64);
        // Positions keep growing past the size: the second lap's offsets wrap.
        ring.start_at(64 + 48);
        let mut reader = ring.reader();
        let payload: Vec<u8> = (1..=20).collect();
        assert_eq!(ring.produce(&payload, 0), 48);
        ring.produce(b"after", 0);
        assert_eq!(next(&mut reader), Some(payload));
        assert_eq!(reader.joined_records, 1);
        assert_eq!(next(&mut reader).as_deref(), Some(&b"after"[..]));
        assert_eq!(ring.consumer(), 64 + 48 + 32 + 16);
    }

    #[test]
    fn a_record_whose_bytes_start_the_next_lap_is_not_joined() {
        let mut ring = FakeRing::new(64);
        ring.start_at(56);
        let mut reader = ring.reader();
        ring.produce(b"0123456789", 0);
        assert_eq!(next(&mut reader).as_deref(), Some(&b"0123456789"[..]));
        assert_eq!(reader.joined_records, 0);
    }

    #[test]
    fn a_busy_record_waits_and_a_discarded_one_is_stepped_over() {
        let mut ring = FakeRing::new(64);
        let mut reader = ring.reader();
        let busy = ring.produce(b"later", BUSY_BIT);
        ring.produce(b"next", 0);
        assert_eq!(next(&mut reader), None);
        assert_eq!(ring.consumer(), 0);
        ring.set_flags(busy, 5, DISCARD_BIT);
        assert_eq!(next(&mut reader).as_deref(), Some(&b"next"[..]));
        assert_eq!(ring.consumer(), 32);
    }

    #[test]
    fn a_length_larger_than_the_ring_stops_the_reading() {
        let mut ring = FakeRing::new(64);
        let mut reader = ring.reader();
        let at = ring.produce(b"x", 0);
        ring.set_flags(at, 1000, 0);
        assert_eq!(next(&mut reader), None);
        ring.produce(b"y", 0);
        assert_eq!(next(&mut reader), None);
        assert_eq!(ring.consumer(), 0);
    }
}
