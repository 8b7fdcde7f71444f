//! Executable file mappings of traced processes (`openat` then `mmap` with `PROT_EXEC`: how
//! ld.so and dlopen load code), so userspace knows which file an address lies in even when
//! the process is gone before its maps can be read.
use core::ffi::c_void;

use aya_ebpf::{bindings::BPF_ANY, helpers::generated, programs::TracePointContext};
use memtrace_common::{FILENAME_LEN, MappingRecord, RecordType, unwind_mode};

use crate::{
    context::{is_traced, pid_tgid, scratch},
    maps::{FD_PATHS, MMAP_ARGS, MmapArgs, OPENAT_ARGS},
    ring::{emit_waking, this_ring},
};

// ---------------------------------------------------------------------------------------
// Executable file mappings (learned-rule call graphs only).
// ---------------------------------------------------------------------------------------

/// Syscall tracepoints share one layout: the arguments, 8 bytes each, from offset 16 (after
/// the common header and the syscall number); the return value of `sys_exit_*` at 16.
pub(crate) const SYSCALL_ARG: usize = 16;
pub(crate) const SYSCALL_RET: usize = 16;
pub(crate) const PROT_EXEC: u64 = 4;

#[inline(always)]
pub(crate) fn tracks_mappings(tgid: u32) -> bool {
    config!(dwarf_unwind) != unwind_mode::FRAME_POINTERS && config!(user_stacks) != 0 && is_traced(tgid)
}

tracepoint_program!(sys_enter_openat, |ctx| try_enter_openat(ctx));

pub(crate) fn try_enter_openat(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    if !tracks_mappings(tgid) {
        return Ok(());
    }
    // SAFETY: checked read of the tracepoint record (openat's second argument).
    let filename: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 8) }.map_err(|_| ())?;
    OPENAT_ARGS.insert(id, filename, BPF_ANY as u64).map_err(|_| ())
}

tracepoint_program!(sys_exit_openat, |ctx| try_exit_openat(ctx));

pub(crate) fn try_exit_openat(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    // SAFETY: copied out at once.
    let filename = *unsafe { OPENAT_ARGS.get(id) }.ok_or(())?;
    let _ = OPENAT_ARGS.remove(id);
    // SAFETY: checked read of the tracepoint record.
    let fd: i64 = unsafe { ctx.read_at(SYSCALL_RET) }.map_err(|_| ())?;
    if fd < 0 {
        return Ok(());
    }
    let scratch = scratch().ok_or(())?;
    let buf = scratch.record.as_mut_ptr();
    // SAFETY: the record buffer is far longer than FILENAME_LEN; the read is checked and
    // NUL-terminates what it copies.
    let n = unsafe {
        generated::bpf_probe_read_user_str(buf as *mut c_void, FILENAME_LEN as u32, filename as *const c_void)
    };
    if n <= 1 {
        return Ok(());
    }
    // SAFETY: the first FILENAME_LEN bytes of the buffer are readable as an array.
    let path = unsafe { &*(buf as *const [u8; FILENAME_LEN]) };
    FD_PATHS.insert((u64::from(tgid) << 32) | fd as u64, path, BPF_ANY as u64).map_err(|_| ())
}

tracepoint_program!(sys_enter_mmap, |ctx| try_enter_mmap(ctx));

pub(crate) fn try_enter_mmap(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    if !tracks_mappings(tgid) {
        return Ok(());
    }
    // SAFETY (the four reads): checked reads of the tracepoint record: len, prot, fd, off.
    let len: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 8) }.map_err(|_| ())?;
    let prot: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 16) }.map_err(|_| ())?;
    let fd: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 32) }.map_err(|_| ())?;
    let offset: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 40) }.map_err(|_| ())?;
    if prot & PROT_EXEC == 0 || (fd as i64) < 0 {
        return Ok(());
    }
    MMAP_ARGS.insert(id, MmapArgs { len, offset, fd }, BPF_ANY as u64).map_err(|_| ())
}

tracepoint_program!(sys_exit_mmap, |ctx| try_exit_mmap(ctx));

pub(crate) fn try_exit_mmap(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    // SAFETY: copied out at once.
    let args = *unsafe { MMAP_ARGS.get(id) }.ok_or(())?;
    let _ = MMAP_ARGS.remove(id);
    // SAFETY: checked read of the tracepoint record.
    let start: u64 = unsafe { ctx.read_at(SYSCALL_RET) }.map_err(|_| ())?;
    if start >= (-4095i64) as u64 {
        return Ok(()); // an error code
    }
    // SAFETY: copied into the record below before the map can change it.
    let path = unsafe { FD_PATHS.get((u64::from(tgid) << 32) | (args.fd & 0xffff_ffff)) }.ok_or(())?;
    let ring = this_ring().ok_or(())?;
    emit_waking::<MappingRecord>(ring, true, |r| {
        r.rtype = RecordType::Mapping as u8;
        r.pid = tgid;
        r.start = start;
        r.len = args.len;
        r.file_offset = args.offset;
        r.path = *path;
    });
    Ok(())
}
