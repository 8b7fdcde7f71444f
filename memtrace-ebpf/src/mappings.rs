//! Executable mappings of traced processes after their exec (how ld.so and dlopen load
//! libraries, and where JIT code goes), from the raw syscall tracepoints: `openat` names a
//! file descriptor, `mmap` with `PROT_EXEC` maps it (or `mprotect` makes memory
//! executable, as JITs commit their code), so userspace knows which file an
//! address lies in, builds its unwind table and installs the range in the address space,
//! even when the process is gone before its maps can be read. (The program and its interpreter, which the kernel maps during
//! exec, come with the exec record; see `task`.)
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{BPF_ANY, pt_regs},
    helpers::generated,
    programs::RawTracePointContext,
};
use memtrace_common::{FILENAME_LEN, MappingRecord, RecordType, mapping_record};

use crate::{
    context::{is_traced_or_pending, pid_tgid, read_kernel_at, read_kernel_u64, scratch},
    maps::{FD_PATHS, MMAP_ARGS, MmapArgs, OPENAT_ARGS},
    path::{copy_into, memtrace_file_path, path_buffer},
    ring::{emit_waking, this_ring},
    syscall,
    unwind::{asid_of, file_table, install_range},
};

/// The `struct file` behind file descriptor `fd` of the current task.
#[inline(always)]
fn fd_file(fd: u32) -> Option<u64> {
    let layout = config!(kernel);
    // SAFETY: no preconditions; the task stays valid while this program runs.
    let task = unsafe { aya_ebpf::helpers::generated::bpf_get_current_task() };
    let files: u64 = read_kernel_at(task, layout.task_files).filter(|&f| f != 0)?;
    let fdt: u64 = read_kernel_at(files, layout.files_fdt).filter(|&f| f != 0)?;
    let fds: u64 = read_kernel_at(fdt, layout.fdtable_fd).filter(|&f| f != 0)?;
    read_kernel_at::<u64>(fds, fd.wrapping_mul(8)).filter(|&f| f != 0)
}

/// The x86-64 numbers of the syscalls followed.
const NR_MMAP: u64 = 9;
const NR_MPROTECT: u64 = 10;
const NR_PKEY_MPROTECT: u64 = 329;
const NR_OPENAT: u64 = 257;
/// The uprobe machinery's own syscalls (x86-64, Linux 6.11 and 6.18): the return
/// trampoline of every return probe, and an optimized probe's entry. Each memtrace return
/// probe makes one; they allocate nothing for the task and open no syscall window.
const NR_URETPROBE: u64 = 335;
const NR_UPROBE: u64 = 336;

/// Whether syscall `nr` is the uprobe machinery's (see [`NR_URETPROBE`]).
#[inline(always)]
fn is_uprobe_syscall(nr: u64) -> bool {
    nr == NR_URETPROBE || nr == NR_UPROBE
}
/// The code segment of a 64-bit task's user mode; a 32-bit task's syscalls number
/// differently and are left alone, as the `syscalls:` tracepoints leave them.
const USER_CS_64: u64 = 0x33;
const PROT_EXEC: u64 = 4;
const MAP_ANONYMOUS: u64 = 0x20;

#[inline(always)]
fn tracks_mappings(tgid: u32) -> bool {
    config!(track_mappings) != 0 && is_traced_or_pending(tgid)
}

/// A user register of the syscall, from the `pt_regs` the raw syscall tracepoints give.
macro_rules! user_reg {
    ($regs:expr, $field:ident) => {
        // SAFETY: the address of a field of the kernel's pt_regs; the read is checked.
        read_kernel_u64(unsafe { core::ptr::addr_of!((*$regs).$field) }).ok_or(())?
    };
}

// The raw `sys_enter`/`sys_exit` tracepoints rather than `syscalls:sys_*_openat`/`mmap`:
// each of those is a perf event whose detach waits 70–190 ms for grace periods; a raw
// tracepoint's costs nothing, and its programs return at once for other syscalls.
raw_tracepoint_program!(sys_enter, |ctx| try_sys_enter(ctx));

/// sys_enter(struct pt_regs *regs, long id): opens the CPU's syscall window (`syscall`);
/// remembers the arguments of a traced task's `openat` (the path) and executable `mmap`
/// until the call returns.
fn try_sys_enter(ctx: &RawTracePointContext) -> Result<(), ()> {
    let nr: u64 = ctx.arg(1);
    if is_uprobe_syscall(nr) {
        // A return probe's trampoline, once per traced allocation: cheapest first.
        return Ok(());
    }
    syscall::enter();
    if nr != NR_OPENAT && nr != NR_MMAP && nr != NR_MPROTECT && nr != NR_PKEY_MPROTECT {
        return Ok(());
    }
    let (id, tgid, _) = pid_tgid();
    if !tracks_mappings(tgid) {
        return Ok(());
    }
    let regs: *const pt_regs = ctx.arg(0);
    if user_reg!(regs, cs) != USER_CS_64 {
        return Ok(());
    }
    if nr == NR_OPENAT {
        // openat(dirfd, filename, flags, mode)
        let filename = user_reg!(regs, rsi);
        return OPENAT_ARGS.insert(id, filename, BPF_ANY as u64).map_err(|_| ());
    }
    // mmap(addr, len, prot, flags, fd, offset): rdi, rsi, rdx, r10, r8, r9;
    // mprotect(addr, len, prot) and pkey_mprotect(addr, len, prot, pkey): rdi, rsi, rdx.
    let prot = user_reg!(regs, rdx);
    if prot & PROT_EXEC == 0 {
        return Ok(());
    }
    let len = user_reg!(regs, rsi);
    if nr == NR_MPROTECT || nr == NR_PKEY_MPROTECT {
        // Memory made executable (how V8 and other JITs commit their code pages), in whole
        // pages (the address is page-aligned, or the call fails).
        let addr = user_reg!(regs, rdi);
        let len = len.wrapping_add(4095) & !4095;
        let args = MmapArgs { len, offset: 0, fd: u64::MAX, addr };
        return MMAP_ARGS.insert(id, args, BPF_ANY as u64).map_err(|_| ());
    }
    let flags = user_reg!(regs, r10);
    let fd = user_reg!(regs, r8);
    let offset = user_reg!(regs, r9);
    let fd = if flags & MAP_ANONYMOUS != 0 { u64::MAX } else { fd };
    MMAP_ARGS.insert(id, MmapArgs { len, offset, fd, addr: 0 }, BPF_ANY as u64).map_err(|_| ())
}

raw_tracepoint_program!(sys_exit, |ctx| try_sys_exit(ctx));

/// sys_exit(struct pt_regs *regs, long ret): closes the CPU's syscall window; learns what
/// a traced task's `openat` or executable `mmap` gave.
fn try_sys_exit(ctx: &RawTracePointContext) -> Result<(), ()> {
    // The syscall's number, from the task's user registers as a typed kernel pointer: a
    // direct load, where a checked read of the tracepoint's untyped pointer cost a helper
    // call on every syscall (the return trampoline's, once per traced allocation, most).
    // SAFETY: both helpers take the current task, which stays valid while we run, and a
    // task in a syscall has user registers (never null here); the verifier checks the
    // load against the BTF of pt_regs and makes it a faulting-safe one.
    let nr = Some(unsafe {
        (*(generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) as *const pt_regs)).orig_rax
    });
    if nr.is_some_and(is_uprobe_syscall) {
        // No window was opened for it (`try_sys_enter`); the one it would close, if any,
        // belongs to a syscall that has already left.
        return Ok(());
    }
    syscall::exit();
    let nr = nr.ok_or(())?;
    if nr == NR_OPENAT {
        try_exit_openat(ctx.arg(1))
    } else if nr == NR_MMAP || nr == NR_MPROTECT || nr == NR_PKEY_MPROTECT {
        try_exit_mmap(ctx.arg(1))
    } else {
        Ok(())
    }
}

#[inline(always)]
fn try_exit_openat(fd: i64) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    // SAFETY: copied out at once.
    let filename = *unsafe { OPENAT_ARGS.get(id) }.ok_or(())?;
    let _ = OPENAT_ARGS.remove(id);
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

/// An executable `mmap` or `mprotect` returned `ret` (the mapping's start, or 0).
#[inline(always)]
fn try_exit_mmap(ret: u64) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    // SAFETY: copied out at once.
    let args = *unsafe { MMAP_ARGS.get(id) }.ok_or(())?;
    let _ = MMAP_ARGS.remove(id);
    if ret >= (-4095i64) as u64 {
        return Ok(()); // an error code
    }
    let protected = args.addr != 0;
    let start = if protected { args.addr } else { ret };
    let anonymous = args.fd == u64::MAX;
    let asid = asid_of(tgid).unwrap_or(0);
    let file = if anonymous { None } else { fd_file(args.fd as u32) };
    // A file whose table userspace registered: the probes add the range themselves, so
    // the code is walkable before userspace hears of it (a segment whose bias they cannot
    // tell is left to userspace, which knows every segment).
    if asid != 0
        && let Some(file) = file
        && let Some(t) = file_table(file)
        && let Some(delta) = t.delta_at(args.offset, args.len)
    {
        let bias = start.wrapping_sub(args.offset).wrapping_sub(delta);
        install_range(asid, start, start.wrapping_add(args.len), t.slot, bias);
    }
    // SAFETY: copied into the record below before the map can change it.
    let path =
        if anonymous { None } else { unsafe { FD_PATHS.get((u64::from(tgid) << 32) | (args.fd & 0xffff_ffff)) } };
    if !anonymous && path.is_none() {
        return Ok(()); // a file opened before tracing began: known from /proc instead
    }
    // The name `openat` was given means nothing once the process is gone when it was
    // relative (`dlopen("./plugin.so")`, a directory's descriptor) or taken in a chroot
    // (the chroot's `/lib/…/libc.so.6` is not ours): the file's absolute path, from the
    // root of the mount tree, stands for it. Walked here, for the few files mapped
    // executable, not at every open.
    let walked = match file {
        Some(file) if memtrace_file_path(file) != 0 => path_buffer(),
        _ => None,
    };
    let ring = this_ring().ok_or(())?;
    // The reader learns the mapping and builds the file's table at once.
    emit_waking::<MappingRecord>(ring, true, |r| {
        r.rtype = RecordType::Mapping as u8;
        r.pid = tgid;
        r.asid = asid;
        r.flags = if anonymous { mapping_record::ANONYMOUS } else { 0 }
            | if protected { mapping_record::MADE_EXECUTABLE } else { 0 };
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { generated::bpf_ktime_get_ns() };
        r.start = start;
        r.len = args.len;
        r.file_offset = args.offset;
        let from = match (walked, path) {
            (Some(walked), _) => Some(walked),
            (None, Some(path)) => Some(path.as_ptr()),
            (None, None) => None,
        };
        if let Some(from) = from {
            copy_into(&mut r.path, from);
        }
    });
    Ok(())
}
