//! Process lifecycle: fork, thread creation, exec, exit and renames, which keep the traced
//! set and the address-space generations current in the kernel and tell userspace when an
//! address space begins and ends.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_ANY, BPF_RB_FORCE_WAKEUP},
    helpers::{bpf_get_current_comm, bpf_ktime_get_ns, generated},
    programs::TracePointContext,
};
use memtrace_common::{COMM_LEN, FILENAME_LEN, RecordType, TaskEvent, TaskRecord, counter, flags, traced, unwind_mode};

use crate::{
    context::{TpHead, is_traced, pid_tgid},
    maps::{GENERATIONS, Ring, TRACED},
    ring::{bump, emit, emit_waking, this_ring},
    unwind::new_generation,
};

// ---------------------------------------------------------------------------------------
// Task lifecycle.
// ---------------------------------------------------------------------------------------

#[inline(always)]
pub(crate) fn emit_task(ring: &Ring, event: TaskEvent, pid: u32, tid: u32, ppid: u32, extra_flags: u8) {
    emit_waking::<TaskRecord>(ring, event == TaskEvent::Fork, |r| {
        r.rtype = RecordType::Task as u8;
        r.event = event as u8;
        r.flags = extra_flags;
        r.pid = pid;
        r.tid = tid;
        r.ppid = ppid;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        if let Ok(comm) = bpf_get_current_comm() {
            r.comm = comm;
        }
    });
}

tracepoint_program!(task_newtask, |ctx| try_task_newtask(ctx));

pub(crate) fn try_task_newtask(ctx: &TracePointContext) -> Result<(), ()> {
    const CLONE_THREAD: u64 = 0x0001_0000;
    let (_, parent_tgid, _) = pid_tgid();
    let head = TpHead::read(ctx).ok_or(())?;
    let child = head.u32_at(config!(tp.newtask_pid));
    let clone_flags = head.u64_at(config!(tp.newtask_clone_flags));
    let is_thread = clone_flags & CLONE_THREAD != 0;
    if !is_traced(parent_tgid) {
        return Ok(());
    }
    if !is_thread {
        new_generation(child);
    }
    if !is_thread && config!(trace_all) == 0 && config!(follow_children) != 0 {
        // Children of traced processes are traced (record -- CMD; --follow-forks).
        let _ = TRACED.insert(child, traced::ACTIVE, BPF_ANY as u64);
    }
    let ring = this_ring().ok_or(())?;
    let (event, pid) = if is_thread { (TaskEvent::Thread, parent_tgid) } else { (TaskEvent::Fork, child) };
    emit_task(ring, event, pid, child, parent_tgid, 0);
    Ok(())
}

tracepoint_program!(sched_process_exec, |ctx| try_exec(ctx));

pub(crate) fn try_exec(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if tgid == config!(self_tgid) {
        return Ok(());
    }
    if config!(trace_all) == 0 {
        // SAFETY: plain u32 value.
        match unsafe { TRACED.get(tgid) } {
            Some(&traced::PENDING_EXEC) => {
                let _ = TRACED.insert(tgid, traced::ACTIVE, BPF_ANY as u64);
            }
            Some(_) => {}
            None => return Ok(()),
        }
    }
    new_generation(tgid);
    let head = TpHead::read(ctx).ok_or(())?;
    let loc = head.u32_at(config!(tp.exec_filename));
    let ring = this_ring().ok_or(())?;
    // The reader re-resolves the allocator of the new program: wake it at once.
    let flags = BPF_RB_FORCE_WAKEUP as u64;
    let Some(mut entry) = ring.reserve_untyped::<TaskRecord>(0) else {
        bump(counter::LOST_EVENTS);
        return Ok(());
    };
    let r = entry.as_mut_ptr();
    // SAFETY: the reservation holds one TaskRecord; zeroed, then filled field by field.
    unsafe {
        core::ptr::write_bytes(r, 0, 1);
        (*r).rtype = RecordType::Task as u8;
        (*r).event = TaskEvent::Exec as u8;
        (*r).pid = tgid;
        (*r).tid = tid;
        (*r).ts_ns = bpf_ktime_get_ns();
        if let Ok(comm) = bpf_get_current_comm() {
            (*r).comm = comm;
        }
        // __data_loc: offset in the low 16 bits, length in the high 16.
        let src = (ctx.as_ptr() as *const u8).add((loc & 0xffff) as usize);
        let dst = addr_of_mut!((*r).filename) as *mut u8;
        generated::bpf_probe_read_kernel_str(dst as *mut c_void, FILENAME_LEN as u32, src as *const c_void);
    }
    entry.submit(flags);
    Ok(())
}

tracepoint_program!(sched_process_exit, |ctx| try_exit(ctx));

pub(crate) fn try_exit(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let group_dead = head.u64_at(config!(tp.exit_group_dead) & !7) >> ((config!(tp.exit_group_dead) & 7) * 8);
    let group_dead = group_dead & 0xff != 0;
    if group_dead && config!(trace_all) == 0 {
        let _ = TRACED.remove(tgid);
    }
    if group_dead && config!(dwarf_unwind) != unwind_mode::FRAME_POINTERS {
        let _ = GENERATIONS.remove(tgid);
    }
    let ring = this_ring().ok_or(())?;
    emit_task(ring, TaskEvent::Exit, tgid, tid, 0, if group_dead { flags::GROUP_DEAD } else { 0 });
    Ok(())
}

tracepoint_program!(task_rename, |ctx| try_rename(ctx));

pub(crate) fn try_rename(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    // SAFETY: checked read of the tracepoint record.
    let comm: [u8; COMM_LEN] = unsafe { ctx.read_at(config!(tp.rename_newcomm) as usize) }.map_err(|_| ())?;
    let ring = this_ring().ok_or(())?;
    emit::<TaskRecord>(ring, |r| {
        r.rtype = RecordType::Task as u8;
        r.event = TaskEvent::Rename as u8;
        r.pid = tgid;
        r.tid = tid;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.comm = comm;
    });
    Ok(())
}
