//! The user-stack walk over a copy of the stack: the same steps the probes take over live
//! memory (memtrace-ebpf `walk_user_dwarf`), so a stack finished here is the one the probes
//! will produce once they know the rules.
use memtrace_common::{MAX_STACK_DEPTH, UPROBE_TRAMPOLINE_PAGE, UnwindRule, sigframe, unwind_kind};

/// Registers of one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Regs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// `ip` is the exact instruction (first frame of a kernel event, a frame a signal
    /// interrupted), not a return address.
    pub exact: bool,
}

impl Regs {
    /// Where this frame's rule is looked up: inside the call instruction for a return
    /// address (the instruction after a call may belong to another function).
    pub fn lookup_addr(&self) -> u64 {
        if self.exact { self.ip } else { self.ip.wrapping_sub(1) }
    }
}

/// Bytes of a user stack copied from `base` upwards.
pub struct StackCopy<'a> {
    pub base: u64,
    pub bytes: &'a [u8],
}

impl StackCopy<'_> {
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let start = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        let word = self.bytes.get(start..start.checked_add(8)?)?;
        Some(u64::from_le_bytes(word.try_into().ok()?))
    }
}

/// How a walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// At the outermost frame: the stack is whole.
    Outermost,
    /// At code without usable unwind information, at the end of the copy, or at the depth
    /// limit.
    Truncated,
}

/// One step: the caller's registers, or None where the walk cannot go on.
pub fn step(regs: Regs, rule: UnwindRule, memory: &StackCopy) -> Option<Regs> {
    match rule.kind {
        unwind_kind::SIGNAL => Some(Regs {
            ip: memory.read_u64(regs.sp.wrapping_add(sigframe::RIP))?,
            sp: memory.read_u64(regs.sp.wrapping_add(sigframe::RSP))?,
            bp: memory.read_u64(regs.sp.wrapping_add(sigframe::RBP))?,
            exact: true,
        }),
        unwind_kind::CFA_SP | unwind_kind::CFA_BP | unwind_kind::CFA_BP_DEREF => {
            let offset = i64::from(rule.cfa_offset) as u64;
            let cfa = match rule.kind {
                unwind_kind::CFA_SP => regs.sp.wrapping_add(offset),
                unwind_kind::CFA_BP => regs.bp.wrapping_add(offset),
                _ => memory.read_u64(regs.bp.wrapping_add(offset))?,
            };
            let ip = memory.read_u64(cfa.wrapping_sub(8))?;
            let bp = if rule.rbp_offset != 0 {
                memory.read_u64(cfa.wrapping_add(i64::from(rule.rbp_offset) as u64))?
            } else {
                regs.bp
            };
            Some(Regs { ip, sp: cfa, bp, exact: false })
        }
        _ => None,
    }
}

/// Walks on from `regs`, whose instruction pointer is already the last of `ips`, appending
/// the callers' up to [`MAX_STACK_DEPTH`] frames in all. `rule_at` gives the rule for a
/// lookup address (None: unknown, the walk stops). A return address replaced by the uprobe
/// trampoline is put back as `trampoline_stands_for` (0: unknown, the walk stops).
pub fn walk(
    mut regs: Regs,
    memory: &StackCopy,
    ips: &mut Vec<u64>,
    trampoline_stands_for: u64,
    mut rule_at: impl FnMut(u64) -> Option<UnwindRule>,
) -> End {
    loop {
        let Some(rule) = rule_at(regs.lookup_addr()) else { return End::Truncated };
        if rule.kind == unwind_kind::OUTERMOST {
            return End::Outermost;
        }
        let Some(mut next) = step(regs, rule, memory) else { return End::Truncated };
        if next.ip == 0 {
            return End::Outermost;
        }
        if next.ip & !0xfff == UPROBE_TRAMPOLINE_PAGE {
            if trampoline_stands_for == 0 {
                return End::Truncated;
            }
            next.ip = trampoline_stands_for;
        }
        if ips.len() >= MAX_STACK_DEPTH {
            return End::Truncated;
        }
        ips.push(next.ip);
        regs = next;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const BASE: u64 = 0x7fff_0000;

    fn rule(kind: u8, cfa_offset: i32, rbp_offset: i16) -> UnwindRule {
        UnwindRule { cfa_offset, rbp_offset, kind, _pad: 0 }
    }

    /// A stack image: (address, value) words from BASE.
    fn stack(words: &[(u64, u64)]) -> Vec<u8> {
        let mut bytes = vec![0u8; 4096];
        for &(addr, value) in words {
            let at = (addr - BASE) as usize;
            bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        bytes
    }

    #[test]
    fn walks_frames_with_and_without_frame_pointers_through_a_signal_frame() {
        // leaf (no frame pointer, 0x20 bytes of frame) → signal trampoline → interrupted
        // function (frame pointer) → outermost.
        let signal_sp = BASE + 0x28;
        let interrupted_bp = BASE + 0x400;
        let bytes = stack(&[
            (BASE + 0x20, 0x5000), // leaf's return address: into the trampoline
            (signal_sp + sigframe::RIP, 0x6000),
            (signal_sp + sigframe::RSP, BASE + 0x300),
            (signal_sp + sigframe::RBP, interrupted_bp),
            (interrupted_bp, BASE + 0x800), // the caller's saved rbp
            (interrupted_bp + 8, 0x7000),   // return address
        ]);
        let rules: HashMap<u64, UnwindRule> = [
            (0x40ff, rule(unwind_kind::CFA_SP, 0x28, 0)),
            // The trampoline's lookup address is its return address − 1.
            (0x5000 - 1, rule(unwind_kind::SIGNAL, 0, 0)),
            // The interrupted instruction is looked up exactly.
            (0x6000, rule(unwind_kind::CFA_BP, 16, -16)),
            (0x7000 - 1, rule(unwind_kind::OUTERMOST, 0, 0)),
        ]
        .into();
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let mut ips = vec![0x4100];
        let regs = Regs { ip: 0x4100, sp: BASE, bp: 0, exact: false };
        let end = walk(regs, &memory, &mut ips, 0, |a| rules.get(&a).copied());
        assert_eq!(end, End::Outermost);
        assert_eq!(ips, vec![0x4100, 0x5000, 0x6000, 0x7000]);
    }

    #[test]
    fn unknown_code_and_the_end_of_the_copy_truncate() {
        let bytes = stack(&[(BASE + 8, 0x2000)]);
        let memory = StackCopy { base: BASE, bytes: &bytes[..16] };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: 0, exact: true };
        let mut ips = vec![0x1000];
        // Unknown code.
        assert_eq!(walk(regs, &memory, &mut ips, 0, |_| None), End::Truncated);
        assert_eq!(ips, vec![0x1000]);
        // One frame, then a read past the copy.
        let r = rule(unwind_kind::CFA_SP, 16, 0);
        assert_eq!(walk(regs, &memory, &mut ips, 0, |_| Some(r)), End::Truncated);
        assert_eq!(ips, vec![0x1000, 0x2000]);
    }

    #[test]
    fn a_zero_return_address_ends_the_stack_and_depth_is_bounded() {
        let memory = StackCopy { base: BASE, bytes: &[0u8; 64] };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: 0, exact: true };
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, 0, |_| Some(rule(unwind_kind::CFA_SP, 8, 0))), End::Outermost);
        assert_eq!(ips.len(), 1);

        // A frame that returns to itself with the same stack: every step is valid, so only
        // the depth limit stops it.
        let bytes = stack(&[(BASE, BASE), (BASE + 8, 0x1000)]);
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: BASE, exact: false };
        let mut ips = vec![0x1000];
        let r = rule(unwind_kind::CFA_BP, 16, -16);
        assert_eq!(walk(regs, &memory, &mut ips, 0, |_| Some(r)), End::Truncated);
        assert_eq!(ips.len(), MAX_STACK_DEPTH);
    }

    #[test]
    fn the_uprobe_trampoline_is_seen_through() {
        let bytes = stack(&[(BASE + 8, UPROBE_TRAMPOLINE_PAGE), (BASE + 24, 0x3000)]);
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: 0, exact: true };
        let rules: HashMap<u64, UnwindRule> = [
            (0x1000, rule(unwind_kind::CFA_SP, 16, 0)),
            (0x1fff, rule(unwind_kind::CFA_SP, 16, 0)),
            (0x2fff, rule(unwind_kind::OUTERMOST, 0, 0)),
        ]
        .into();
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, 0x2000, |a| rules.get(&a).copied()), End::Outermost);
        assert_eq!(ips, vec![0x1000, 0x2000, 0x3000]);
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, 0, |a| rules.get(&a).copied()), End::Truncated);
        assert_eq!(ips, vec![0x1000]);
    }

    #[test]
    fn reads_are_bounds_checked() {
        let memory = StackCopy { base: BASE, bytes: &[1, 0, 0, 0, 0, 0, 0, 0, 2] };
        assert_eq!(memory.read_u64(BASE), Some(1));
        assert_eq!(memory.read_u64(BASE + 1), Some(2 << 56));
        assert_eq!(memory.read_u64(BASE + 2), None);
        assert_eq!(memory.read_u64(BASE - 8), None);
        assert_eq!(memory.read_u64(u64::MAX), None);
    }
}
