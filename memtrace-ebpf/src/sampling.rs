//! Size-weighted sampling of user allocations: each byte is sampled with probability
//! 1/mean, by a per-CPU countdown drawn from an exponential distribution.
use aya_ebpf::{bindings::BPF_NOEXIST, helpers::generated};
use memtrace_common::SampledKey;

use crate::maps::{SAMPLE_COUNTDOWN, SAMPLE_OVERRIDE, SAMPLED_FILTER, SAMPLED_FILTER_SLOTS, SAMPLED_LIVE};

/// The sampling period in force: configured, or switched on by userspace under load.
#[inline(always)]
pub(crate) fn sampling_mean() -> u64 {
    let configured = config!(sample_bytes);
    if configured != 0 {
        return configured;
    }
    SAMPLE_OVERRIDE.get(0).copied().unwrap_or(0)
}

/// Whether only the frees of blocks in SAMPLED_LIVE are sent: configured sampling, or the
/// overload switch once the blocks live at the switch are in the map.
#[inline(always)]
pub(crate) fn frees_filtered() -> bool {
    config!(sample_bytes) != 0 || SAMPLE_OVERRIDE.get(1).is_some_and(|f| *f != 0)
}

/// log2(1 + k/16) in Q16, for the exponential sampling intervals.
pub(crate) const LOG2_1_PLUS: [u32; 17] =
    [0, 5732, 11136, 16248, 21098, 25711, 30109, 34312, 38336, 42196, 45904, 49472, 52911, 56229, 59434, 62534, 65536];

/// An exponentially distributed number of bytes with mean `mean`: -ln(U)·mean, U uniform
/// in (0, 1], computed in fixed point (log2 by leading zeros and a 16-entry table).
#[inline(always)]
pub(crate) fn exponential_bytes(mean: u64) -> u64 {
    // SAFETY: no preconditions.
    let r = unsafe { generated::bpf_get_prandom_u32() } | 1;
    let msb = 31 - r.leading_zeros();
    let frac = if msb >= 20 { (r >> (msb - 20)) & 0xf_ffff } else { (r << (20 - msb)) & 0xf_ffff };
    let idx = ((frac >> 16) & 15) as usize;
    let (lo, hi) = (LOG2_1_PLUS[idx], LOG2_1_PLUS[idx + 1]);
    let log2_r = (msb << 16) + lo + (((hi - lo) * (frac & 0xffff)) >> 16);
    let minus_log2_u = u64::from((32 << 16) - log2_r);
    // ln 2 = 45426 / 65536. Userspace keeps `mean` below 2^40, so neither product can
    // overflow (mean·2^21, then 2^45·2^16).
    ((mean.wrapping_mul(minus_log2_u) >> 16).wrapping_mul(45426) >> 16).max(1)
}

/// Whether an allocation of `size` bytes is sampled: each byte with probability
/// 1/`mean`, so large blocks are nearly always sampled and small ones rarely.
#[inline(always)]
pub(crate) fn sample_hit(size: u64, mean: u64) -> bool {
    let Some(slot) = SAMPLE_COUNTDOWN.get_ptr_mut(0) else { return true };
    // SAFETY: this CPU's slot; programs on one CPU do not run concurrently.
    let remaining = unsafe { &mut *slot };
    let size = size.min(i64::MAX as u64) as i64;
    if *remaining == 0 {
        // Not drawn yet on this CPU (the map starts zeroed; a countdown is never 0 after a
        // draw or a step): drawn now, so the first call on each CPU is not always sampled
        // (that counted a phantom block per CPU at the first site each CPU met).
        *remaining = exponential_bytes(mean).min(i64::MAX as u64) as i64;
    }
    if *remaining > size {
        *remaining -= size;
        return false;
    }
    *remaining = exponential_bytes(mean).min(i64::MAX as u64) as i64;
    true
}

#[inline(always)]
pub(crate) fn sampled_key(tgid: u32, ptr: u64) -> SampledKey {
    SampledKey { tgid, _pad: 0, ptr }
}

/// The slot of `SAMPLED_FILTER` that block `key` counts in.
#[inline(always)]
fn filter_slot(key: &SampledKey) -> u32 {
    const _: () = assert!(SAMPLED_FILTER_SLOTS.is_power_of_two());
    let h = (key.ptr ^ (u64::from(key.tgid) << 47)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (h >> 40) as u32 & (SAMPLED_FILTER_SLOTS - 1)
}

/// Whether block `key` may be in `SAMPLED_LIVE` (false: certainly not). Only sampling
/// configured from the start keeps the filter; otherwise true, and the set is asked.
#[inline(always)]
pub(crate) fn may_be_sampled(key: &SampledKey) -> bool {
    if config!(sample_bytes) == 0 {
        return true;
    }
    SAMPLED_FILTER.get(filter_slot(key)).is_none_or(|&n| n != 0)
}

/// Adds block `key` to `SAMPLED_LIVE` (and its count to the filter); false when the set is
/// full.
#[inline(always)]
pub(crate) fn insert_sampled(key: SampledKey) -> bool {
    if SAMPLED_LIVE.insert(key, 1u8, BPF_NOEXIST as u64).is_err() {
        // Already there (an address handed out again before its free was seen: counted
        // once), or the set is full.
        // SAFETY: plain byte value.
        return unsafe { SAMPLED_LIVE.get(key) }.is_some();
    }
    filter_add(&key, 1);
    true
}

/// Removes block `key` from `SAMPLED_LIVE` (and its count from the filter); whether it was
/// there.
#[inline(always)]
pub(crate) fn remove_sampled(key: SampledKey) -> bool {
    if SAMPLED_LIVE.remove(key).is_err() {
        return false;
    }
    filter_add(&key, u64::MAX); // -1
    true
}

#[inline(always)]
fn filter_add(key: &SampledKey, delta: u64) {
    if config!(sample_bytes) == 0 {
        return;
    }
    if let Some(slot) = SAMPLED_FILTER.get_ptr_mut(filter_slot(key)) {
        // SAFETY: a word of a global array, changed atomically (BPF_ATOMIC add): CPUs count
        // into it at once.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(slot, delta)
        };
    }
}
