//! GPU memory, from the CUDA driver API (`libcuda.so.1` or any module exporting it): one
//! entry and one return program for every allocating function (the attach cookie is its
//! `Kind`) and one entry program for the frees. The out-parameters (device pointer, handle,
//! pitch) are read at return, and only a call that returned `CUDA_SUCCESS` is an
//! allocation; a failed one is sent with [`flags::FAILED`] and its stack (taken by
//! `finish::user_finish`, which the return program tail-calls). The in-flight
//! state is kept apart from the malloc family's, so the host allocations the driver makes
//! inside a call are still seen. On kernels with uprobe sessions the entry and return run
//! as one program, `gpu_session`, as the malloc family's do (`uprobes::alloc_session`).
use aya_ebpf::{
    EbpfContext,
    bindings::BPF_ANY,
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user, generated},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use memtrace_common::{Kind, RecordType, counter, flags};

use crate::{
    context::{is_traced, pid_tgid, regs},
    finish::{Half, Next, finish_user_alloc, pend_user_alloc},
    maps::{GPU_INFLIGHT, GpuInFlight},
    ring::bump,
    uprobes::{length_in_pages, run_session, send_free},
};

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: u32 = 1;

#[uprobe]
pub fn gpu_enter(ctx: ProbeContext) -> u32 {
    let _ = try_gpu_enter(&ctx);
    0
}

/// The entry and return as one uprobe session program (see `uprobes::alloc_session`, whose
/// way of telling the two runs apart it shares).
#[unsafe(no_mangle)]
#[unsafe(link_section = "uprobe")]
pub fn gpu_session(ctx: *mut core::ffi::c_void) -> u32 {
    run_session(ctx, try_gpu_enter, try_gpu_return)
}

/// Keeps the call's arguments for its return; whether the return needs to run.
fn try_gpu_enter(ctx: &ProbeContext) -> Result<bool, ()> {
    let (id, tgid, _) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(false);
    }
    // SAFETY: ctx is this probe's pt_regs.
    let sp = unsafe { (*regs(ctx)).rsp };
    // SAFETY: copied out at once.
    if let Some(state) = unsafe { GPU_INFLIGHT.get(id) }
        && sp < state.sp
    {
        return Ok(false); // an entry point the driver calls from inside another: not the user's
    }
    // SAFETY: the helper only reads the attach cookie of this program's link.
    let kind = unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) } as u8;
    let arg = |n: usize| -> u64 { ctx.arg::<u64>(n).unwrap_or(0) };
    let mut state =
        GpuInFlight { kind, device: 0, _pad: [0; 6], sp, bytes_req: arg(1), out: arg(0), pitch: 0, height: 0 };
    match Kind::from_u8(kind) {
        // (dptr*, pitch*, width, height, element size)
        Some(Kind::GpuPitched) => {
            state.pitch = arg(1);
            state.height = arg(3);
            state.bytes_req = arg(2).wrapping_mul(arg(3));
        }
        // (handle*, size, const CUmemAllocationProp*, flags): the device is in the properties.
        Some(Kind::GpuPhysical) => {
            let prop = arg(2);
            // SAFETY: checked reads of the caller's structure.
            let location: [u32; 2] = unsafe { bpf_probe_read_user((prop + 8) as *const [u32; 2]) }.unwrap_or([0; 2]);
            if location[0] == LOCATION_DEVICE && location[1] < 255 {
                state.device = location[1] as u8 + 1;
            }
        }
        // (ptr, size, offset, handle, flags): nothing to read back.
        Some(Kind::GpuMap) => state.out = 0,
        Some(
            Kind::GpuDevice
            | Kind::GpuAsync
            | Kind::GpuPool
            | Kind::GpuManaged
            | Kind::GpuReserve
            | Kind::GpuHostPinned,
        ) => {}
        _ => return Err(()),
    }
    if kind == Kind::GpuMap as u8 {
        state.pitch = arg(0); // the address mapped
    }
    if GPU_INFLIGHT.insert(id, state, BPF_ANY as u64).is_err() {
        bump(counter::LOST_INFLIGHT);
        return Ok(false);
    }
    Ok(true)
}

#[uretprobe]
pub fn gpu_return(ctx: RetProbeContext) -> u32 {
    if try_gpu_return(&ctx) == Ok(Next::Finish) {
        finish_user_alloc(&ctx, Half::Return);
    }
    0
}

fn try_gpu_return(ctx: &RetProbeContext) -> Result<Next, ()> {
    let (id, tgid, tid) = pid_tgid();
    // SAFETY: copied out at once.
    let state = *unsafe { GPU_INFLIGHT.get(id) }.ok_or(())?;
    // SAFETY: ctx is the return probe's pt_regs.
    let sp = unsafe { (*regs(ctx)).rsp };
    if sp < state.sp + 8 {
        return Ok(Next::Done); // the return of a nested entry point
    }
    let _ = GPU_INFLIGHT.remove(id);
    if sp != state.sp + 8 {
        return Ok(Next::Done); // stale entry: its return was missed
    }
    // CUresult is a 32-bit enum.
    let result = ctx.ret::<u64>() as u32;
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let mut bytes_alloc = state.bytes_req;
    let ptr = if result != 0 {
        u64::from(result)
    } else if state.kind == Kind::GpuMap as u8 {
        state.pitch
    } else {
        if state.kind == Kind::GpuPitched as u8 {
            // SAFETY: checked read of the caller's pitch.
            let pitch: u64 = unsafe { bpf_probe_read_user(state.pitch as *const u64) }.unwrap_or(0);
            if pitch != 0 {
                bytes_alloc = pitch.wrapping_mul(state.height);
            }
        }
        // SAFETY: checked read of the caller's result slot (a pointer or a 64-bit handle).
        unsafe { bpf_probe_read_user(state.out as *const u64) }.map_err(|_| ())?
    };
    let failed = result != 0;
    pend_user_alloc(None, |r| {
        r.rtype = RecordType::UserAlloc as u8;
        r.kind = state.kind;
        r.allocator = state.device;
        // What the API reports it gave (pitch × height) is exact: `bytes_extra` is its
        // excess over the request.
        r.flags = if failed { flags::FAILED } else { flags::USABLE_EXACT };
        r.pid = tgid;
        r.tid = tid;
        r.bytes_extra =
            if failed { 0 } else { bytes_alloc.saturating_sub(state.bytes_req).min(u32::MAX as u64) as u32 };
        r.ts_ns = now;
        r.ptr = ptr;
        r.bytes_req = state.bytes_req;
    })
}

#[uprobe]
pub fn gpu_free(ctx: ProbeContext) -> u32 {
    let _ = try_gpu_free(&ctx);
    0
}

fn try_gpu_free(ctx: &ProbeContext) -> Result<(), ()> {
    let ptr: u64 = ctx.arg(0).ok_or(())?;
    if ptr == 0 {
        return Ok(());
    }
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    // SAFETY: the helper only reads the attach cookie.
    let kind = unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) } as u8;
    // cuMemUnmap(ptr, size): every mapping starting in the range goes.
    let pages = if kind == Kind::GpuUnmap as u8 { length_in_pages(ctx) } else { 0 };
    send_free(kind, tgid, tid, ptr, pages)
}
