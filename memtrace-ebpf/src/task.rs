//! Process lifecycle: fork, thread creation, exec, exit and renames (raw tracepoints). They
//! keep the traced set and the address-space ids current in the kernel, at the moment things
//! happen, and tell userspace when an address space begins (with where exec mapped the
//! program and its interpreter) and ends.
use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_get_current_comm, bpf_ktime_get_ns},
    programs::RawTracePointContext,
};
use memtrace_common::{COMM_LEN, RecordType, TaskEvent, TaskRecord, flags, traced};

use crate::{
    context::{is_traced, is_traced_or_pending, pid_tgid, read_kernel_at, read_kernel_str},
    maps::{Ring, TRACED, traced_changed},
    path::{copy_into, memtrace_file_path, path_buffer},
    ring::{emit_waking, this_ring},
    unwind::{asid_of, begin_address_space, end_address_space, file_table, install_range, share_address_space},
};

/// What a task record says beyond its kind.
struct TaskFacts {
    pid: u32,
    tid: u32,
    ppid: u32,
    asid: u32,
    flags: u8,
}

#[inline(always)]
fn emit_task(ring: &Ring, event: TaskEvent, facts: TaskFacts, fill: impl FnOnce(&mut TaskRecord)) {
    // New processes and programs: the reader handles them in the drain that reads them.
    let wake = matches!(event, TaskEvent::Fork | TaskEvent::Exec);
    emit_waking::<TaskRecord>(ring, wake, |r| {
        r.rtype = RecordType::Task as u8;
        r.event = event as u8;
        r.flags = facts.flags;
        r.pid = facts.pid;
        r.tid = facts.tid;
        r.ppid = facts.ppid;
        r.asid = facts.asid;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        if let Ok(comm) = bpf_get_current_comm() {
            r.comm = comm;
        }
        fill(r);
    });
}

raw_tracepoint_program!(task_newtask, |ctx| try_task_newtask(ctx));

/// task_newtask(struct task_struct *task, u64 clone_flags)
fn try_task_newtask(ctx: &RawTracePointContext) -> Result<(), ()> {
    const CLONE_THREAD: u64 = 0x0001_0000;
    const CLONE_VM: u64 = 0x0000_0100;
    let (_, parent_tgid, _) = pid_tgid();
    if !is_traced(parent_tgid) {
        return Ok(());
    }
    let task: u64 = ctx.arg(0);
    let clone_flags: u64 = ctx.arg(1);
    let child_tid: u32 = read_kernel_at(task, config!(kernel.task_pid)).ok_or(())?;
    let child_tgid: u32 = read_kernel_at(task, config!(kernel.task_tgid)).ok_or(())?;
    let is_thread = clone_flags & CLONE_THREAD != 0;
    if !is_thread {
        // Only a child that will be traced gets an address space: one not followed sends no
        // exit, so its entry stayed in `ASIDS` (and counted in its parent's space in
        // userspace, whose ranges then outlived it in the probes) for the whole session; a
        // server forking 65,536 workers under `--pid` would have filled the map, leaving
        // later execs without an address space.
        if config!(trace_all) != 0 || config!(follow_children) != 0 {
            share_address_space(child_tgid, parent_tgid);
        }
        if config!(trace_all) == 0 && config!(follow_children) != 0 {
            // Children of traced processes are traced from their first instruction
            // (record -- CMD; --follow-forks).
            let _ = TRACED.insert(child_tgid, traced::ACTIVE, BPF_ANY as u64);
            traced_changed();
        }
    }
    let ring = this_ring().ok_or(())?;
    let (event, pid) = if is_thread { (TaskEvent::Thread, parent_tgid) } else { (TaskEvent::Fork, child_tgid) };
    let asid = asid_of(pid).unwrap_or(0);
    let flags = if !is_thread && clone_flags & CLONE_VM != 0 { flags::SHARED_MEMORY } else { 0 };
    emit_task(ring, event, TaskFacts { pid, tid: child_tid, ppid: parent_tgid, asid, flags }, |_| {});
    Ok(())
}

/// `AT_BASE` in the auxiliary vector: where the interpreter was loaded.
const AT_BASE: u64 = 7;
/// Pairs of the auxiliary vector looked through.
const AUXV_PAIRS: u32 = 32;

/// Where exec mapped the program's code and its interpreter: (start_code, end_code,
/// AT_BASE) of the task's new memory.
#[inline(always)]
fn exec_layout(task: u64) -> (u64, u64, u64) {
    let layout = config!(kernel);
    let Some(mm) = read_kernel_at::<u64>(task, layout.task_mm).filter(|&mm| mm != 0) else { return (0, 0, 0) };
    let start: u64 = read_kernel_at(mm, layout.mm_start_code).unwrap_or(0);
    let end: u64 = read_kernel_at(mm, layout.mm_end_code).unwrap_or(0);
    let mut base = 0;
    for i in 0..AUXV_PAIRS {
        let at = layout.mm_saved_auxv + i * 16;
        let Some(kind) = read_kernel_at::<u64>(mm, at) else { break };
        if kind == 0 {
            break;
        }
        if kind == AT_BASE {
            base = read_kernel_at(mm, at + 8).unwrap_or(0);
            break;
        }
    }
    (start, end, base)
}

raw_tracepoint_program!(sched_process_exec, |ctx| try_exec(ctx));

/// sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
fn try_exec(ctx: &RawTracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if tgid == config!(self_tgid) {
        return Ok(());
    }
    if config!(trace_all) == 0 {
        // SAFETY: plain u32 value.
        match unsafe { TRACED.get(tgid) } {
            Some(&traced::PENDING_EXEC) => {
                let _ = TRACED.insert(tgid, traced::ACTIVE, BPF_ANY as u64);
                traced_changed();
            }
            Some(_) => {}
            None => return Ok(()),
        }
    }
    // A new program, a new address space.
    if is_traced_or_pending(tgid) {
        begin_address_space(tgid);
    }
    let task: u64 = ctx.arg(0);
    let bprm: u64 = ctx.arg(2);
    let filename: u64 = read_kernel_at(bprm, config!(kernel.binprm_filename)).unwrap_or(0);
    let (code_start, code_end, interp_base) = exec_layout(task);
    let asid = asid_of(tgid).unwrap_or(0);
    let file = read_kernel_at::<u64>(bprm, config!(kernel.binprm_file)).unwrap_or(0);
    // A program whose table (and its interpreter's) userspace registered gets its code
    // into the new address space now, before its first instruction.
    if asid != 0
        && file != 0
        && let Some(t) = file_table(file)
    {
        install_range(asid, code_start, code_end, t.slot, code_start.wrapping_sub(t.exec_vaddr));
        if interp_base != 0 {
            let start = interp_base + t.interp_exec_vaddr;
            install_range(asid, start, start + t.interp_exec_size, t.interp_slot, interp_base);
        }
    }
    // The name exec was given means nothing once the process is gone when it is relative
    // (`./prog`: to a working directory) or taken in a chroot (`/prog`: from its root); the
    // file's absolute path, from the root of the mount tree, stands for it.
    let path = if memtrace_file_path(file) != 0 { path_buffer() } else { None };
    let flags = if path.is_some() { flags::EXE_PATH } else { 0 };
    let ring = this_ring().ok_or(())?;
    emit_task(ring, TaskEvent::Exec, TaskFacts { pid: tgid, tid, ppid: 0, asid, flags }, |r| {
        if let Some(path) = path {
            copy_into(&mut r.filename, path);
        } else if filename != 0 {
            read_kernel_str(filename, &mut r.filename);
        }
        r.code_start = code_start;
        r.code_end = code_end;
        r.interp_base = interp_base;
    });
    Ok(())
}

raw_tracepoint_program!(sched_process_exit, |ctx| try_exit(ctx));

/// sched_process_exit(struct task_struct *p[, bool group_dead])
fn try_exit(ctx: &RawTracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let group_dead = if config!(kernel.exit_has_group_dead) != 0 {
        let arg: u64 = ctx.arg(1);
        arg & 0xff != 0
    } else {
        tid == tgid
    };
    // The process stays traced until its task is freed (`sched_process_free`): the
    // kernel frees its memory after this tracepoint (since 6.16 `exit_mm` comes after
    // it), allocating page-table batches as it does.
    if group_dead {
        end_address_space(tgid);
    }
    let ring = this_ring().ok_or(())?;
    let flags = if group_dead { flags::GROUP_DEAD } else { 0 };
    emit_task(ring, TaskEvent::Exit, TaskFacts { pid: tgid, tid, ppid: 0, asid: 0, flags }, |_| {});
    Ok(())
}

raw_tracepoint_program!(sched_process_free, |ctx| try_free(ctx));

/// sched_process_free(struct task_struct *p): a task's last reference goes. A process
/// leaves the traced set when its leader's does, which is after every thread of it
/// exited and its parent reaped it.
fn try_free(ctx: &RawTracePointContext) -> Result<(), ()> {
    if config!(trace_all) != 0 {
        return Ok(());
    }
    let task: u64 = ctx.arg(0);
    let tgid: u32 = read_kernel_at(task, config!(kernel.task_tgid)).ok_or(())?;
    let tid: u32 = read_kernel_at(task, config!(kernel.task_pid)).ok_or(())?;
    // SAFETY: the value is a plain u32, only tested for presence.
    if tid != tgid || unsafe { TRACED.get(tgid) }.is_none() {
        return Ok(());
    }
    let _ = TRACED.remove(tgid);
    traced_changed();
    Ok(())
}

raw_tracepoint_program!(task_rename, |ctx| try_rename(ctx));

/// task_rename(struct task_struct *task, const char *comm)
fn try_rename(ctx: &RawTracePointContext) -> Result<(), ()> {
    let task: u64 = ctx.arg(0);
    let comm_ptr: u64 = ctx.arg(1);
    let tgid: u32 = read_kernel_at(task, config!(kernel.task_tgid)).ok_or(())?;
    let tid: u32 = read_kernel_at(task, config!(kernel.task_pid)).ok_or(())?;
    if !is_traced(tgid) {
        return Ok(());
    }
    let mut comm = [0u8; COMM_LEN];
    read_kernel_str(comm_ptr, &mut comm);
    let ring = this_ring().ok_or(())?;
    emit_task(ring, TaskEvent::Rename, TaskFacts { pid: tgid, tid, ppid: 0, asid: 0, flags: 0 }, |r| {
        r.comm = comm;
    });
    Ok(())
}
