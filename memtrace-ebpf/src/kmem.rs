//! The kernel's allocators: the kmem tracepoints for slab objects (kmalloc, kmem caches)
//! and pages, with the kernel stack joined to the user stack of the task they ran for, and
//! the frees of blocks traced tasks allocated, from any context.
use aya_ebpf::{EbpfContext, bindings::BPF_ANY, helpers::bpf_ktime_get_ns, programs::TracePointContext};
use memtrace_common::{FreeRecord, KernelAllocRecord, Kind, RecordType, counter, flags};

use crate::{
    context::{TpHead, is_traced, pid_tgid},
    maps::{KERNEL_LIVE, PAGE_KEY},
    ring::{bump, emit, this_ring},
    stack::kernel_stack,
};

#[inline(always)]
pub(crate) fn remember_kernel_block(key: u64) {
    if config!(track_kernel_live) != 0 && KERNEL_LIVE.insert(key, 1u8, BPF_ANY as u64).is_err() {
        bump(counter::LOST_KERNEL_LIVE);
    }
}

/// Whether a kernel free of `key` should be reported, and whether it comes from a context
/// that is not itself traced.
#[inline(always)]
pub(crate) fn kernel_free_wanted(key: u64, tgid: u32) -> Option<bool> {
    if config!(track_kernel_live) == 0 {
        return if is_traced(tgid) { Some(false) } else { None };
    }
    // SAFETY: plain byte value.
    unsafe { KERNEL_LIVE.get(key) }?;
    let _ = KERNEL_LIVE.remove(key);
    Some(!is_traced(tgid))
}

#[inline(always)]
pub(crate) fn slab_alloc(ctx: &TracePointContext, kind: Kind, layout_is_cache: bool) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let (call_site, ptr, req, alloc, gfp, node) = if layout_is_cache {
        (
            head.u64_at(config!(tp.cache_alloc.call_site)),
            head.u64_at(config!(tp.cache_alloc.ptr)),
            head.u64_at(config!(tp.cache_alloc.bytes_req)),
            head.u64_at(config!(tp.cache_alloc.bytes_alloc)),
            head.u64_at(config!(tp.cache_alloc.gfp_flags)),
            head.u32_at(config!(tp.cache_alloc.node)),
        )
    } else {
        (
            head.u64_at(config!(tp.kmalloc.call_site)),
            head.u64_at(config!(tp.kmalloc.ptr)),
            head.u64_at(config!(tp.kmalloc.bytes_req)),
            head.u64_at(config!(tp.kmalloc.bytes_alloc)),
            head.u64_at(config!(tp.kmalloc.gfp_flags)),
            head.u32_at(config!(tp.kmalloc.node)),
        )
    };
    if ptr == 0 {
        return Ok(()); // failed allocation
    }
    let ring = this_ring().ok_or(())?;
    let stack = kernel_stack(ctx.as_ptr(), ring, tgid);
    remember_kernel_block(ptr);
    emit::<KernelAllocRecord>(ring, |r| {
        r.rtype = RecordType::KernelAlloc as u8;
        r.kind = kind as u8;
        r.flags = if stack.is_some() { flags::HAS_STACK } else { 0 };
        r.pid = tgid;
        r.tid = tid;
        r.node = node as i32;
        r.bytes_req = req.min(u32::MAX as u64) as u32;
        r.bytes_alloc = alloc.min(u32::MAX as u64) as u32;
        r.gfp_flags = gfp as u32;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = ptr;
        r.call_site = call_site;
        r.stack = stack.unwrap_or(0);
    });
    Ok(())
}

#[inline(always)]
pub(crate) fn kernel_free(ctx: &TracePointContext, kind: Kind, ptr: u64, key: u64, arg: u32) -> Result<(), ()> {
    if ptr == 0 {
        return Ok(());
    }
    let (_, tgid, tid) = pid_tgid();
    let foreign = kernel_free_wanted(key, tgid).ok_or(())?;
    let _ = ctx;
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

tracepoint_program!(kmalloc, |ctx| slab_alloc(ctx, Kind::Kmalloc, false));

tracepoint_program!(kmem_cache_alloc, |ctx| slab_alloc(ctx, Kind::KmemCacheAlloc, true));

tracepoint_program!(kfree, |ctx| try_slab_free(ctx, Kind::Kfree, config!(tp.kfree_ptr)));

tracepoint_program!(kmem_cache_free, |ctx| try_slab_free(ctx, Kind::KmemCacheFree, config!(tp.cache_free_ptr)));

#[inline(always)]
pub(crate) fn try_slab_free(ctx: &TracePointContext, kind: Kind, ptr_offset: u32) -> Result<(), ()> {
    // SAFETY: checked read of the tracepoint record.
    let ptr: u64 = unsafe { ctx.read_at(ptr_offset as usize) }.map_err(|_| ())?;
    kernel_free(ctx, kind, ptr, ptr, 0)
}

tracepoint_program!(mm_page_alloc, |ctx| try_page_alloc(ctx));

pub(crate) fn try_page_alloc(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let pfn = head.u64_at(config!(tp.page_alloc_pfn));
    if pfn == u64::MAX {
        return Ok(()); // failed allocation
    }
    let order = head.u32_at(config!(tp.page_alloc_order));
    let gfp = head.u64_at(config!(tp.page_alloc_gfp));
    let migratetype = head.u32_at(config!(tp.page_alloc_migratetype));
    let ring = this_ring().ok_or(())?;
    let stack = kernel_stack(ctx.as_ptr(), ring, tgid);
    remember_kernel_block(pfn | PAGE_KEY);
    let bytes = 4096u32 << (order & 15);
    emit::<KernelAllocRecord>(ring, |r| {
        r.rtype = RecordType::KernelAlloc as u8;
        r.kind = Kind::PageAlloc as u8;
        r.flags = if stack.is_some() { flags::HAS_STACK } else { 0 };
        r.order = order as u8;
        r.pid = tgid;
        r.tid = tid;
        r.node = migratetype as i32;
        r.bytes_req = bytes;
        r.bytes_alloc = bytes;
        r.gfp_flags = gfp as u32;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = pfn;
        r.stack = stack.unwrap_or(0);
    });
    Ok(())
}

tracepoint_program!(mm_page_free, |ctx| try_page_free(ctx, config!(tp.page_free_pfn), config!(tp.page_free_order)));

tracepoint_program!(mm_page_free_batched, |ctx| try_page_free(ctx, config!(tp.page_free_batched_pfn), u32::MAX));

#[inline(always)]
pub(crate) fn try_page_free(ctx: &TracePointContext, pfn_offset: u32, order_offset: u32) -> Result<(), ()> {
    let head = TpHead::read(ctx).ok_or(())?;
    let pfn = head.u64_at(pfn_offset);
    let order = if order_offset == u32::MAX { 0 } else { head.u32_at(order_offset) };
    kernel_free(ctx, Kind::PageFree, pfn, pfn | PAGE_KEY, order)
}
