//! The user-stack walk over a copy of the stack, for the frames the probes could not walk
//! because a file's table was not ready: the same step the probes take over live memory
//! (`memtrace_common::unwind::step`), so a stack finished here is the one the probes
//! produce once the table is installed.
use memtrace_common::{
    MAX_USER_DEPTH, UnwindRule,
    unwind::{Regs, Step, step},
};

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

/// What the rule lookup of one frame found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Rule(UnwindRule),
    /// The frame's file table is still being built: try again later.
    Wait,
}

/// How a walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// At the outermost frame: the stack is whole.
    Outermost,
    /// At code without usable unwind information, at the end of the copy, or at the depth
    /// limit.
    Truncated,
    /// At a frame whose table is not ready.
    Wait,
    /// On the anchor of this index.
    Anchored(usize),
}

/// A frame the probes walked from an anchor after a miss (see
/// `memtrace_common::UnwindMiss`): a walk of the gap below that lands on it exactly (same
/// stack pointer, same return address) has reached the probes' frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    pub sp: u64,
    pub ip: u64,
    /// The %rbp the frame must have too (the probes' walk from it relied on it).
    pub bp: Option<u64>,
}

/// What `step` is told the uprobe trampoline stands for, to see where it met one: no code
/// is at address 1.
const TRAMPOLINE_SEEN: u64 = 1;

/// Walks on from `regs`, whose instruction pointer is already the last of `ips`, appending
/// the callers' up to [`MAX_USER_DEPTH`] frames in all. `rule_at` gives the rule for a
/// lookup address. A return address replaced by the uprobe trampoline is put back from
/// `returns` (slot, return address), by the slot it was read from, as the probes do: each
/// trampoline its own (nested return probes: `mmap`'s inside `malloc`'s); at a slot not
/// there the walk stops. The walk ends on the first of `anchors` it lands on
/// ([`End::Anchored`] with its index; its frame not appended); past them all it goes on as
/// without.
pub fn walk(
    mut regs: Regs,
    memory: &StackCopy,
    ips: &mut Vec<u64>,
    returns: &[(u64, u64)],
    anchors: &[Anchor],
    mut rule_at: impl FnMut(u64) -> Lookup,
) -> End {
    loop {
        let rule = match rule_at(regs.lookup_addr()) {
            Lookup::Rule(rule) => rule,
            Lookup::Wait => return End::Wait,
        };
        match step(regs, rule, TRAMPOLINE_SEEN, |a| memory.read_u64(a)) {
            Step::Caller(mut next) => {
                if next.ip == TRAMPOLINE_SEEN {
                    // The return address was read from the slot just below the caller's
                    // stack pointer (the CFA).
                    let slot = next.sp.wrapping_sub(8);
                    match returns.iter().find(|r| r.0 == slot) {
                        Some(&(_, ip)) if ip != 0 => next.ip = ip,
                        _ => return End::Truncated,
                    }
                }
                if let Some(k) = anchors
                    .iter()
                    .position(|a| a.sp == next.sp && a.ip == next.ip && a.bp.is_none_or(|bp| bp == next.bp))
                {
                    return End::Anchored(k);
                }
                if ips.len() >= MAX_USER_DEPTH {
                    return End::Truncated;
                }
                ips.push(next.ip);
                regs = next;
            }
            Step::Outermost => return End::Outermost,
            Step::Stop => return End::Truncated,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use memtrace_common::unwind::{UPROBE_TRAMPOLINE_PAGE, kind, sigframe};

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

    fn lookup(rules: &HashMap<u64, UnwindRule>) -> impl FnMut(u64) -> Lookup + '_ {
        |a| Lookup::Rule(rules.get(&a).copied().unwrap_or(UnwindRule::STOP))
    }

    #[test]
    fn walks_frames_with_and_without_frame_pointers_through_a_signal_frame() {
        let signal_sp = BASE + 0x28;
        let interrupted_bp = BASE + 0x400;
        let bytes = stack(&[
            (BASE + 0x20, 0x5000),
            (signal_sp + sigframe::RIP, 0x6000),
            (signal_sp + sigframe::RSP, BASE + 0x300),
            (signal_sp + sigframe::RBP, interrupted_bp),
            (interrupted_bp, BASE + 0x800),
            (interrupted_bp + 8, 0x7000),
        ]);
        let rules: HashMap<u64, UnwindRule> = [
            (0x40ff, rule(kind::CFA_SP, 0x28, 0)),
            (0x5000 - 1, UnwindRule::SIGNAL),
            (0x6000, rule(kind::CFA_BP, 16, -16)),
            (0x7000 - 1, UnwindRule::OUTERMOST),
        ]
        .into();
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let mut ips = vec![0x4100];
        let regs = Regs { ip: 0x4100, sp: BASE, bp: 0, exact: false };
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], lookup(&rules)), End::Outermost);
        assert_eq!(ips, vec![0x4100, 0x5000, 0x6000, 0x7000]);
    }

    #[test]
    fn unknown_code_the_end_of_the_copy_and_a_pending_table() {
        let bytes = stack(&[(BASE + 8, 0x2000)]);
        let memory = StackCopy { base: BASE, bytes: &bytes[..16] };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: 0, exact: true };
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], |_| Lookup::Rule(UnwindRule::STOP)), End::Truncated);
        assert_eq!(ips, vec![0x1000]);
        let r = rule(kind::CFA_SP, 16, 0);
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], |_| Lookup::Rule(r)), End::Truncated);
        assert_eq!(ips, vec![0x1000, 0x2000]);
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], |_| Lookup::Wait), End::Wait);
    }

    #[test]
    fn depth_is_bounded_and_the_trampoline_seen_through() {
        // A chain of frame pointers deeper than the bound, each frame 16 bytes above the last.
        let frames = MAX_USER_DEPTH as u64 + 8;
        let mut bytes = vec![0u8; (frames * 16 + 16) as usize];
        for k in 0..frames {
            let at = (k * 16) as usize;
            bytes[at..at + 8].copy_from_slice(&(BASE + 16 * (k + 1)).to_le_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&0x1000u64.to_le_bytes());
        }
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: BASE, exact: false };
        let mut ips = vec![0x1000];
        let r = rule(kind::CFA_BP, 16, -16);
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], |_| Lookup::Rule(r)), End::Truncated);
        assert_eq!(ips.len(), MAX_USER_DEPTH);
        // A %rbp that loops on itself gives a frame at the stack pointer: not a frame.
        let bytes = stack(&[(BASE, BASE), (BASE + 8, 0x1000)]);
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], |_| Lookup::Rule(r)), End::Truncated);
        assert_eq!(ips, vec![0x1000, 0x1000]);

        // Two return probes' trampolines, one inside the other (`mmap`'s in `malloc`'s):
        // each put back by its own slot; one whose slot is not known stops the walk.
        let bytes = stack(&[(BASE + 8, UPROBE_TRAMPOLINE_PAGE), (BASE + 24, UPROBE_TRAMPOLINE_PAGE)]);
        let memory = StackCopy { base: BASE, bytes: &bytes };
        let regs = Regs { ip: 0x1000, sp: BASE, bp: 0, exact: true };
        let rules: HashMap<u64, UnwindRule> =
            [(0x1000, rule(kind::CFA_SP, 16, 0)), (0x1fff, rule(kind::CFA_SP, 16, 0)), (0x2fff, UnwindRule::OUTERMOST)]
                .into();
        let mut ips = vec![0x1000];
        let returns = [(BASE + 8, 0x2000), (BASE + 24, 0x3000)];
        assert_eq!(walk(regs, &memory, &mut ips, &returns, &[], lookup(&rules)), End::Outermost);
        assert_eq!(ips, vec![0x1000, 0x2000, 0x3000]);
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, &returns[..1], &[], lookup(&rules)), End::Truncated);
        assert_eq!(ips, vec![0x1000, 0x2000]);
        let mut ips = vec![0x1000];
        assert_eq!(walk(regs, &memory, &mut ips, &[], &[], lookup(&rules)), End::Truncated);
        assert_eq!(ips, vec![0x1000]);
    }

    /// A gap of two frames under an anchor: the walk lands on the frame with the anchor's
    /// stack pointer and return address, and on one wanting a %rbp only with that %rbp.
    #[test]
    fn the_walk_of_a_gap_lands_on_an_anchor_only_where_it_matches() {
        // 0x1000 (the miss) at BASE, frame of 0x20 → 0x2000; its frame of 0x10, saving
        // %rbp at CFA-16 → 0x3000 (the anchor), at BASE + 0x30.
        let saved_bp = 0xbeef;
        let bytes = stack(&[(BASE + 0x18, 0x2000), (BASE + 0x20, saved_bp), (BASE + 0x28, 0x3000)]);
        let memory = StackCopy { base: BASE, bytes: &bytes[..0x30] };
        let rules: HashMap<u64, UnwindRule> =
            [(0x1000, rule(kind::CFA_SP, 0x20, 0)), (0x1fff, rule(kind::CFA_SP, 0x10, -16))].into();
        let regs = Regs { ip: 0x1000, sp: BASE, bp: 7, exact: true };
        let landed = |anchor: Anchor| {
            let mut ips = vec![0x1000];
            let end = walk(regs, &memory, &mut ips, &[], &[anchor], lookup(&rules));
            (end, ips)
        };
        let anchor = Anchor { sp: BASE + 0x30, ip: 0x3000, bp: None };
        assert_eq!(landed(anchor), (End::Anchored(0), vec![0x1000, 0x2000]));
        assert_eq!(landed(Anchor { bp: Some(saved_bp), ..anchor }).0, End::Anchored(0));
        // Another %rbp there, another stack pointer, another return address: no landing
        // (the walk goes on, and here leaves the copy).
        for other in [
            Anchor { bp: Some(saved_bp + 1), ..anchor },
            Anchor { sp: BASE + 0x38, ..anchor },
            Anchor { ip: 0x3001, ..anchor },
        ] {
            assert_eq!(landed(other).0, End::Truncated, "{other:?}");
        }
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
