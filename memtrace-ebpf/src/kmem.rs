//! The kernel's allocators: the kmem raw tracepoints for slab objects (kmalloc, kmem caches)
//! and pages, with the kernel stack joined to the user stack of the task they ran for, and
//! the frees of blocks traced tasks allocated, from any context. The stacks are taken in
//! `finish::kmem_finish`, which the allocation programs tail-call. (The bulk slab calls have
//! no per-object tracepoint; fentry/fexit on them is refused on the machines memtrace runs
//! on, so their blocks are paired by address reuse in userspace.)
use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_ktime_get_ns, programs::RawTracePointContext};
use memtrace_common::{CACHE_NAME_LEN, CacheRecord, FreeRecord, Kind, RecordType, counter, flags};

use crate::{
    context::{is_traced, pid_tgid, read_kernel_at, read_kernel_str},
    finish::{Next, finish_kernel_alloc, pend_kernel_alloc},
    maps::{CACHES_SENT, KERNEL_LIVE, PAGE_KEY, Ring},
    ring::{bump, bump_by, emit, this_ring},
    unwind::probe_busy,
};

#[inline(always)]
fn remember_kernel_block(key: u64) {
    if config!(track_kernel_live) != 0 && KERNEL_LIVE.insert(key, 1u8, BPF_ANY as u64).is_err() {
        bump(counter::LOST_KERNEL_LIVE);
    }
}

/// Whether a kernel free of `key` should be reported, and whether it comes from a context
/// that is not itself traced.
#[inline(always)]
fn kernel_free_wanted(key: u64, tgid: u32) -> Option<bool> {
    if config!(track_kernel_live) == 0 {
        return if is_traced(tgid) { Some(false) } else { None };
    }
    // SAFETY: plain byte value.
    unsafe { KERNEL_LIVE.get(key) }?;
    let _ = KERNEL_LIVE.remove(key);
    Some(!is_traced(tgid))
}

/// Sends the name of slab cache `cache` once.
#[inline(always)]
fn name_cache_once(ring: &Ring, cache: u64) {
    // SAFETY: plain byte value.
    if cache == 0 || unsafe { CACHES_SENT.get(cache) }.is_some() {
        return;
    }
    let Some(name) = read_kernel_at::<u64>(cache, config!(kernel.cache_name)) else { return };
    let _ = CACHES_SENT.insert(cache, 1u8, BPF_ANY as u64);
    emit::<CacheRecord>(ring, |r| {
        r.rtype = RecordType::Cache as u8;
        r.cache = cache;
        let mut buf = [0u8; CACHE_NAME_LEN];
        read_kernel_str(name, &mut buf);
        r.name = buf;
    });
}

/// Whether the kernel allocates `bytes` for one of our own programs (see
/// [`probe_busy`]): left out, counted for the report's "not counted" line.
#[inline(always)]
fn probes_own(bytes: u64) -> bool {
    if !probe_busy() {
        return false;
    }
    bump(counter::PROBE_BUSY_ALLOCS);
    bump_by(counter::PROBE_BUSY_BYTES, bytes);
    true
}

/// One slab allocation.
struct SlabAlloc {
    kind: Kind,
    call_site: u64,
    ptr: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    gfp: u64,
    node: u32,
    cache: u64,
}

/// A slab allocation by the current task, pending its stack.
#[inline(always)]
fn pend_slab_alloc(a: &SlabAlloc) -> Result<Next, ()> {
    let (_, tgid, tid) = pid_tgid();
    remember_kernel_block(a.ptr);
    pend_kernel_alloc(|r| {
        r.rtype = RecordType::KernelAlloc as u8;
        r.kind = a.kind as u8;
        r.pid = tgid;
        r.tid = tid;
        r.node = a.node as i32;
        r.bytes_req = a.bytes_req.min(u32::MAX as u64) as u32;
        r.bytes_alloc = a.bytes_alloc.min(u32::MAX as u64) as u32;
        r.gfp_flags = a.gfp as u32;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = a.ptr;
        r.call_site = a.call_site;
        r.cache = a.cache;
    })
}

/// The object and allocation sizes of a slab cache (`object_size`, `size`).
#[inline(always)]
fn cache_sizes(cache: u64) -> (u64, u64) {
    let object: u32 = read_kernel_at(cache, config!(kernel.cache_object_size)).unwrap_or(0);
    let size: u32 = read_kernel_at(cache, config!(kernel.cache_size)).unwrap_or(0);
    (u64::from(object), u64::from(size))
}

raw_tracepoint_program!(kmalloc, |ctx| try_kmalloc(ctx) => finish_kernel_alloc);

/// kmalloc(call_site, ptr, bytes_req, bytes_alloc, gfp_flags, node)
fn try_kmalloc(ctx: &RawTracePointContext) -> Result<Next, ()> {
    let (_, tgid, _) = pid_tgid();
    let ptr: u64 = ctx.arg(1);
    if !is_traced(tgid) || ptr == 0 || probes_own(ctx.arg(3)) {
        return Ok(Next::Done);
    }
    let a = SlabAlloc {
        kind: Kind::Kmalloc,
        call_site: ctx.arg(0),
        ptr,
        bytes_req: ctx.arg(2),
        bytes_alloc: ctx.arg(3),
        gfp: ctx.arg(4),
        node: ctx.arg(5),
        cache: 0,
    };
    pend_slab_alloc(&a)
}

raw_tracepoint_program!(kmem_cache_alloc, |ctx| try_cache_alloc(ctx) => finish_kernel_alloc);

/// kmem_cache_alloc(call_site, ptr, struct kmem_cache *s, gfp_flags, node)
fn try_cache_alloc(ctx: &RawTracePointContext) -> Result<Next, ()> {
    let (_, tgid, _) = pid_tgid();
    let ptr: u64 = ctx.arg(1);
    if !is_traced(tgid) || ptr == 0 {
        return Ok(Next::Done);
    }
    let cache: u64 = ctx.arg(2);
    let (bytes_req, bytes_alloc) = cache_sizes(cache);
    if probes_own(bytes_alloc) {
        return Ok(Next::Done);
    }
    let a = SlabAlloc {
        kind: Kind::KmemCacheAlloc,
        call_site: ctx.arg(0),
        ptr,
        bytes_req,
        bytes_alloc,
        gfp: ctx.arg(3),
        node: ctx.arg(4),
        cache,
    };
    name_cache_once(this_ring().ok_or(())?, cache);
    pend_slab_alloc(&a)
}

#[inline(always)]
fn kernel_free(kind: Kind, ptr: u64, key: u64, arg: u32) -> Result<(), ()> {
    if ptr == 0 {
        return Ok(());
    }
    let (_, tgid, tid) = pid_tgid();
    let foreign = kernel_free_wanted(key, tgid).ok_or(())?;
    let ring = this_ring().ok_or(())?;
    emit::<FreeRecord>(ring, |r| {
        r.rtype = RecordType::Free as u8;
        r.kind = kind as u8;
        r.flags = if foreign { flags::FOREIGN_FREE } else { 0 };
        r.pid = tgid;
        r.tid = tid;
        r.arg = arg;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = ptr;
    });
    Ok(())
}

raw_tracepoint_program!(kfree, |ctx| {
    let ptr: u64 = ctx.arg(1);
    kernel_free(Kind::Kfree, ptr, ptr, 0)
});

raw_tracepoint_program!(kmem_cache_free, |ctx| {
    let ptr: u64 = ctx.arg(1);
    kernel_free(Kind::KmemCacheFree, ptr, ptr, 0)
});

raw_tracepoint_program!(mm_page_alloc, |ctx| try_page_alloc(ctx) => finish_kernel_alloc);

/// mm_page_alloc(struct page *page, order, gfp_flags, migratetype)
fn try_page_alloc(ctx: &RawTracePointContext) -> Result<Next, ()> {
    let (_, tgid, tid) = pid_tgid();
    let page: u64 = ctx.arg(0);
    let order: u32 = ctx.arg(1);
    if !is_traced(tgid) || page == 0 || probes_own(4096u64 << (order & 15)) {
        return Ok(Next::Done);
    }
    let gfp: u64 = ctx.arg(2);
    let migratetype: u32 = ctx.arg(3);
    remember_kernel_block(page | PAGE_KEY);
    let bytes = 4096u32 << (order & 15);
    pend_kernel_alloc(|r| {
        r.rtype = RecordType::KernelAlloc as u8;
        r.kind = Kind::PageAlloc as u8;
        r.order = order as u8;
        r.pid = tgid;
        r.tid = tid;
        r.node = migratetype as i32;
        r.bytes_req = bytes;
        r.bytes_alloc = bytes;
        r.gfp_flags = gfp as u32;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = page;
    })
}

raw_tracepoint_program!(mm_page_free, |ctx| {
    let page: u64 = ctx.arg(0);
    let order: u32 = ctx.arg(1);
    kernel_free(Kind::PageFree, page, page | PAGE_KEY, order)
});

raw_tracepoint_program!(mm_page_free_batched, |ctx| {
    let page: u64 = ctx.arg(0);
    kernel_free(Kind::PageFree, page, page | PAGE_KEY, 0)
});
