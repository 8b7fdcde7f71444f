//! Writing into the per-CPU rings: finding this CPU's ring, reserving and submitting
//! records with batched wakeups, the loss counters, and the room left for stack copies.
use core::{
    ffi::c_void,
    mem::{align_of, size_of},
};

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_RING_SIZE},
    helpers::generated,
};
use memtrace_common::counter;

use crate::{
    maps::{COUNTERS, RINGS, Ring},
    stack::COPY_ROOM,
};

#[inline(always)]
pub(crate) fn bump(index: u32) {
    bump_by(index, 1);
}

/// Adds `n` to this CPU's counter `index`.
#[inline(always)]
pub(crate) fn bump_by(index: u32, n: u64) {
    if let Some(slot) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot of this CPU; programs on one CPU do not run concurrently.
        unsafe { *slot += n };
    }
}

#[inline(always)]
pub(crate) fn this_ring() -> Option<&'static Ring> {
    let ring = RINGS.get(crate::context::this_cpu());
    if ring.is_none() {
        bump(counter::NO_RING);
    }
    ring
}

/// Submit flags: stay quiet until enough data waits, so the reader wakes per batch.
#[inline(always)]
pub(crate) fn wakeup_flags(ring: &Ring) -> u64 {
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `ring` is a ring buffer map returned by the outer map lookup.
    let waiting = unsafe { generated::bpf_ringbuf_query(ring_ptr, BPF_RB_AVAIL_DATA as u64) };
    if waiting >= config!(wakeup_bytes) as u64 { BPF_RB_FORCE_WAKEUP as u64 } else { BPF_RB_NO_WAKEUP as u64 }
}

/// Reserves a `T` in `ring`, lets `fill` write it, submits it; counts a loss when full.
#[inline(always)]
pub(crate) fn emit<T: 'static>(ring: &Ring, fill: impl FnOnce(&mut T)) {
    emit_waking::<T>(ring, false, fill)
}

/// As [`emit`]; `wake` wakes the reader at once (new processes: it attaches to them).
#[inline(always)]
pub(crate) fn emit_waking<T: 'static>(ring: &Ring, wake: bool, fill: impl FnOnce(&mut T)) {
    emit_deciding::<T>(ring, |r| {
        fill(r);
        wake
    })
}

/// As [`emit`]; the reader is woken at once when `fill` returns true (a record it must act
/// on while the process lives), else per batch.
#[inline(always)]
pub(crate) fn emit_deciding<T: 'static>(ring: &Ring, fill: impl FnOnce(&mut T) -> bool) {
    match ring.reserve_untyped::<T>(0) {
        Some(mut entry) => {
            let p = entry.as_mut_ptr();
            zero_words::<T>(p as *mut u64);
            // SAFETY: the reservation is size_of::<T>() bytes, 8-byte aligned, now zeroed;
            // every record type is plain data for which all-zero is valid.
            let record = unsafe { &mut *p };
            let wake = fill(record);
            entry.submit(if wake { BPF_RB_FORCE_WAKEUP as u64 } else { wakeup_flags(ring) });
        }
        None => bump(counter::LOST_EVENTS),
    }
}

/// Zeroes the `size_of::<T>()` bytes at `p` a word at a time. `write_bytes` became a call
/// of the byte-at-a-time `memset`, which the verifier follows byte by byte at every call
/// site (a 72-byte record: 360 instructions checked, and run, per event); volatile stores
/// keep the compiler from turning the loop back into that call.
#[inline(always)]
fn zero_words<T>(p: *mut u64) {
    const { assert!(size_of::<T>().is_multiple_of(8) && align_of::<T>() >= 8, "records are whole, aligned words") };
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: `p` is the 8-byte aligned reservation of size_of::<T>() bytes.
        unsafe { core::ptr::write_volatile(p.add(i), 0) };
    }
}

/// Zeroes `v` a word at a time (see [`zero_words`]): a struct literal with zeroed arrays
/// in it became a `memset` call too.
#[inline(always)]
pub(crate) fn zero<T>(v: &mut T) {
    zero_words::<T>(v as *mut T as *mut u64);
}

/// Whether a stack copy may go into `ring`: only while a quarter of it stays free, so
/// copies (sent while rules are being learned) never crowd out events (4 MiB of a default
/// ring hold ~100,000). Half, before: on two cores a cold start's reader fell more than
/// half a ring behind and refused up to ~3,800 copies (their stacks cut short).
#[inline(always)]
pub(crate) fn room_for_copy(ring: &Ring) -> bool {
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `ring` is a ring buffer map returned by the outer map lookup.
    let (waiting, size) = unsafe {
        (
            generated::bpf_ringbuf_query(ring_ptr, BPF_RB_AVAIL_DATA as u64),
            generated::bpf_ringbuf_query(ring_ptr, BPF_RB_RING_SIZE as u64),
        )
    };
    waiting + (COPY_ROOM as u64) < size - size / 4
}
