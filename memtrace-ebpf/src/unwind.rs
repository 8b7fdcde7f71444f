//! The user-stack walk by learned call-frame rules, one frame per `bpf_loop` step; where a
//! frame has no rule yet the walk stops with the registers there, for userspace to finish
//! from a stack copy.
use core::{
    ffi::c_void,
    ptr::{addr_of, addr_of_mut},
};

use aya_ebpf::{
    bindings::{BPF_ANY, pt_regs},
    helpers::{bpf_ktime_get_ns, generated},
    programs::RetProbeContext,
};
use memtrace_common::{
    MAX_STACK_DEPTH, UPROBE_TRAMPOLINE_PAGE, UnwindKey, UnwindMiss, sigframe, stack_flags, stack_hash_step,
    unwind_kind, unwind_mode,
};

use crate::{
    context::{pid_tgid, read_kernel_u64, read_user_u64, regs, scratch},
    maps::{GENERATIONS, INFLIGHT, UNWIND},
    stack::Scratch,
};

/// User registers a walk starts from.
#[derive(Clone, Copy)]
pub(crate) struct UserRegs {
    pub(crate) ip: u64,
    pub(crate) sp: u64,
    pub(crate) bp: u64,
    /// `ip` is the exact instruction, not a return address.
    pub(crate) exact: bool,
    /// The return address the uprobe trampoline hides on this stack while an allocator call
    /// runs (0: none).
    pub(crate) hidden_return: u64,
}

impl UserRegs {
    /// At a return probe: `ip` is the return address into the caller of the probed function.
    #[inline(always)]
    pub(crate) fn of_return(ctx: &RetProbeContext) -> Self {
        let r = regs(ctx);
        // SAFETY: ctx is the return probe's pt_regs.
        // After the return nothing on the stack is hidden by the uprobe trampoline.
        unsafe { Self { ip: (*r).rip, sp: (*r).rsp, bp: (*r).rbp, exact: false, hidden_return: 0 } }
    }

    /// The registers the current task entered the kernel with (None for kernel threads).
    #[inline(always)]
    pub(crate) fn of_current_task() -> Option<Self> {
        // SAFETY: both helpers take the current task, which stays valid while we run.
        let r = unsafe { generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) } as *const pt_regs;
        if r.is_null() {
            return None;
        }
        // SAFETY (the three reads): field addresses only; the reads are checked.
        let ip = read_kernel_u64(unsafe { addr_of!((*r).rip) })?;
        let sp = read_kernel_u64(unsafe { addr_of!((*r).rsp) })?;
        let bp = read_kernel_u64(unsafe { addr_of!((*r).rbp) })?;
        // Kernel threads have no user registers (zeroed); user addresses are below 2^47.
        if ip == 0 || ip >= 1 << 47 {
            return None;
        }
        let (id, _, _) = pid_tgid();
        // SAFETY: copied out at once.
        let hidden_return = match unsafe { INFLIGHT.get(id) } {
            Some(s) if s.depth == 0 => s.ret_addr,
            _ => 0,
        };
        Some(Self { ip, sp, bp, exact: true, hidden_return })
    }
}

/// The generation of `tgid`'s address space (see [`GENERATIONS`]).
#[inline(always)]
pub(crate) fn generation(tgid: u32) -> u32 {
    // SAFETY: plain u32 copied out at once.
    unsafe { GENERATIONS.get(tgid) }.copied().unwrap_or(0)
}

/// Gives `tgid` a new address-space generation (it forked or exec'd).
#[inline(always)]
pub(crate) fn new_generation(tgid: u32) {
    if config!(dwarf_unwind) == 0 {
        return;
    }
    // SAFETY: no preconditions. A clock reading differs from the tgid's previous one.
    let generation = unsafe { bpf_ktime_get_ns() } as u32 | 1;
    let _ = GENERATIONS.insert(tgid, generation, BPF_ANY as u64);
}

/// The state of a learned-rule walk, on the BPF stack between `bpf_loop` steps.
#[repr(C)]
pub(crate) struct WalkState {
    pub(crate) ip: u64,
    pub(crate) sp: u64,
    pub(crate) bp: u64,
    /// What the uprobe trampoline stands for, if an allocator call is in progress.
    pub(crate) ret_addr: u64,
    /// The stack hash, continued with each frame.
    pub(crate) hash: u64,
    pub(crate) tgid: u32,
    pub(crate) generation: u32,
    /// Frames in `scratch.user_ips`.
    pub(crate) n: u32,
    /// `ip` is the exact instruction, not a return address.
    pub(crate) exact: u32,
    /// `stack_flags` the walk ended with.
    pub(crate) result: u32,
    pub(crate) _pad: u32,
}

/// One frame of the walk (a `bpf_loop` callback: verified once, whatever the depth).
/// Records the frame, looks its rule up and steps to the caller; returns 1 to stop.
#[inline(never)]
pub(crate) extern "C" fn walk_step(index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the WalkState on the caller's stack.
    let st = unsafe { &mut *(state as *mut WalkState) };
    let Some(scratch) = scratch() else { return 1 };
    let i = index as usize;
    if i >= MAX_STACK_DEPTH {
        return 1;
    }
    scratch.user_ips[i] = st.ip;
    st.n = i as u32 + 1;
    st.hash = stack_hash_step(st.hash, st.ip);
    let (ip, sp, bp) = (st.ip, st.sp, st.bp);
    let key = UnwindKey { tgid: st.tgid, generation: st.generation, addr: if st.exact != 0 { ip } else { ip - 1 } };
    // SAFETY: the rule is copied out at once.
    let rule =
        if config!(dwarf_unwind) == unwind_mode::COPY_ALWAYS { None } else { unsafe { UNWIND.get(key) }.copied() };
    let Some(rule) = rule else {
        scratch.miss = UnwindMiss {
            ip,
            sp,
            bp,
            ret_addr: st.ret_addr,
            generation: st.generation,
            exact: st.exact as u8,
            _pad: [0; 3],
            copy_len: 0,
            _pad2: 0,
        };
        st.result = stack_flags::MISS as u32;
        return 1;
    };
    let next = match rule.kind {
        unwind_kind::OUTERMOST => {
            st.result = 0;
            return 1;
        }
        unwind_kind::SIGNAL => {
            match (
                read_user_u64(sp + sigframe::RIP),
                read_user_u64(sp + sigframe::RSP),
                read_user_u64(sp + sigframe::RBP),
            ) {
                (Some(i), Some(s), Some(b)) => Some((i, s, b, 1)),
                _ => None,
            }
        }
        unwind_kind::CFA_SP | unwind_kind::CFA_BP | unwind_kind::CFA_BP_DEREF => {
            let offset = rule.cfa_offset as i64 as u64;
            let cfa = match rule.kind {
                unwind_kind::CFA_SP => Some(sp.wrapping_add(offset)),
                unwind_kind::CFA_BP => Some(bp.wrapping_add(offset)),
                _ => read_user_u64(bp.wrapping_add(offset)),
            };
            match cfa {
                Some(cfa) => {
                    let ra = read_user_u64(cfa.wrapping_sub(8));
                    let saved_bp = if rule.rbp_offset != 0 {
                        read_user_u64(cfa.wrapping_add(rule.rbp_offset as i64 as u64))
                    } else {
                        Some(bp)
                    };
                    match (ra, saved_bp) {
                        (Some(ra), Some(b)) => Some((ra, cfa, b, 0)),
                        _ => None,
                    }
                }
                None => None,
            }
        }
        _ => None, // STOP: no usable rule for this code
    };
    let Some((next_ip, next_sp, next_bp, next_exact)) = next else {
        st.result = stack_flags::TRUNCATED as u32;
        return 1;
    };
    if next_ip == 0 {
        st.result = 0; // a zero return address ends the chain
        return 1;
    }
    let next_ip = if next_ip & !0xfff == UPROBE_TRAMPOLINE_PAGE { st.ret_addr } else { next_ip };
    if next_ip == 0 {
        st.result = stack_flags::TRUNCATED as u32; // a trampoline we cannot see through
        return 1;
    }
    st.ip = next_ip;
    st.sp = next_sp;
    st.bp = next_bp;
    st.exact = next_exact;
    // Past the last step the walk is cut at the depth limit.
    st.result = stack_flags::TRUNCATED as u32;
    0
}

/// Walks the user stack with the rules learned for it into `scratch.user_ips`, from
/// `regs`, continuing `hash` with each frame. Returns the frame count, `stack_flags`
/// (TRUNCATED, or MISS with `scratch.miss` holding the registers of the frame that had no
/// rule) and the hash.
#[inline(always)]
pub(crate) fn walk_user_dwarf(scratch: &mut Scratch, tgid: u32, regs: UserRegs, hash: u64) -> (usize, u8, u64) {
    let mut st = WalkState {
        ip: regs.ip,
        sp: regs.sp,
        bp: regs.bp,
        ret_addr: regs.hidden_return,
        hash,
        tgid,
        generation: generation(tgid),
        n: 0,
        exact: regs.exact as u32,
        result: stack_flags::TRUNCATED as u32,
        _pad: 0,
    };
    // SAFETY: walk_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe {
        generated::bpf_loop(MAX_STACK_DEPTH as u32, walk_step as *mut c_void, addr_of_mut!(st) as *mut c_void, 0)
    };
    let n = (st.n as usize).min(MAX_STACK_DEPTH);
    if n < MAX_STACK_DEPTH {
        scratch.user_ips[n] = 0;
    }
    scratch.user_ips[MAX_STACK_DEPTH] = 0;
    (n, st.result as u8 | stack_flags::USER_IPS, st.hash)
}
