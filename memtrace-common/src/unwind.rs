//! Unwinding user stacks without frame pointers, as both sides do it: the rule for one
//! frame ([`UnwindRule`], learned from `.eh_frame`/`.debug_frame`), its 8-byte row in a
//! file's table ([`encode_row`]), the table's layout in a BPF array ([`table`]), the
//! binary search that finds a row ([`find_row`]), and the step from a frame to its caller
//! ([`step`]). The probes walk live stacks with exactly this code; userspace walks stack
//! copies with it, so the two can never disagree, and it is tested here, on the host.
//!
//! Tables are per file and shared by every process that maps the file: a process's
//! address space ([`MappingKey`], by address-space id) says which file an address lies in
//! and at which bias.

/// How one frame of user code is unwound. x86-64 only: the walk tracks the instruction,
/// stack and frame pointers; the return address is always at CFA − 8 (rules where it is
/// not are [`kind::STOP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRule {
    /// Added to the register `kind` names to give the canonical frame address.
    pub cfa_offset: i32,
    /// Where the caller's rbp was saved, relative to the CFA; 0: rbp is unchanged.
    pub rbp_offset: i16,
    /// `kind::*`.
    pub kind: u8,
    pub _pad: u8,
}

impl UnwindRule {
    pub const STOP: Self = Self { cfa_offset: 0, rbp_offset: 0, kind: kind::STOP, _pad: 0 };
    pub const OUTERMOST: Self = Self { cfa_offset: 0, rbp_offset: 0, kind: kind::OUTERMOST, _pad: 0 };
    pub const SIGNAL: Self = Self { cfa_offset: 0, rbp_offset: 0, kind: kind::SIGNAL, _pad: 0 };
    /// Code no call-frame information describes (JIT-compiled code, V8's builtins in
    /// node's executable, hand-written assembly, a file without any): followed by its frame
    /// pointer, as `push %rbp; mov %rsp,%rbp` leaves it, the CFA 16 bytes above %rbp and
    /// the caller's %rbp just below the return address. Where %rbp is no frame pointer
    /// there, [`step`]'s checks of the frame it gives stop most walks.
    pub const FRAME_POINTER: Self = Self { cfa_offset: 16, rbp_offset: -16, kind: kind::CFA_BP, _pad: 0 };
}

/// The largest frame a step from %rbp accepts: no frame is larger than a thread's default
/// stack (8 MiB), and a %rbp that is no frame pointer (a value the code keeps there, the
/// parent's in a thread just cloned) mostly points further away, or below the stack pointer.
pub const MAX_BP_FRAME: u64 = 8 << 20;

/// `UnwindRule::kind`.
pub mod kind {
    /// CFA = rsp + offset.
    pub const CFA_SP: u8 = 1;
    /// CFA = rbp + offset.
    pub const CFA_BP: u8 = 2;
    /// CFA = *(rbp + offset): functions that realign their stack (GCC's DRAP in `main`).
    pub const CFA_BP_DEREF: u8 = 3;
    /// The outermost frame (`_start`, `clone3`: the return address is undefined).
    pub const OUTERMOST: u8 = 4;
    /// Code without usable unwind information: the walk stops, the stack is truncated.
    pub const STOP: u8 = 5;
    /// A signal trampoline (`__restore_rt`): rsp points at the `ucontext_t` the kernel
    /// pushed; the interrupted registers are read from it.
    pub const SIGNAL: u8 = 6;
    /// CFA = rsp + offset, and the return address is in %rdi (glibc's `vfork` during its
    /// syscall, which pops it there). Only a syscall's own frame has %rdi known (the
    /// task's saved user registers): the probes follow it there; [`super::step`] stops.
    pub const RA_RDI: u8 = 7;
}

/// Offsets in the x86-64 `ucontext_t` a signal trampoline's rsp points at
/// (`uc_mcontext.gregs[REG_RBP / REG_RSP / REG_RIP]`).
pub mod sigframe {
    pub const RBP: u64 = 40 + 10 * 8;
    pub const RSP: u64 = 40 + 15 * 8;
    pub const RIP: u64 = 40 + 16 * 8;
}

/// The page of the uprobe trampoline return probes plant as return addresses
/// (`[uprobes]`, placed at the top of the x86-64 user address space).
pub const UPROBE_TRAMPOLINE_PAGE: u64 = 0x7fff_ffff_e000;

// A row is 8 bytes: the pc (relative to the table's base) in the high 32 bits, the rule in
// the low 32: kind in bits 0..3, the rbp offset in 8-byte units in bits 3..12 (signed, so
// ±2 KiB), the CFA offset in bits 12..32: bit 12 says its unit, bits 13..32 hold it
// (signed): bytes (±256 KiB) or, for larger frames, 8-byte words (±2 MiB: rustc's
// `run_compiler` closure keeps 527 KiB of locals; a frame past 256 KiB is word-aligned).
const KIND_BITS: u32 = 3;
const RBP_BITS: u32 = 9;
const CFA_BITS: u32 = 20;
/// Bits of the CFA offset's value (the field's other bit is its unit).
const CFA_VALUE_BITS: u32 = CFA_BITS - 1;

const fn fits_signed(v: i64, bits: u32) -> bool {
    let limit = 1i64 << (bits - 1);
    v >= -limit && v < limit
}

/// Packs a rule into 32 bits; a rule whose offsets do not fit (a frame of 2 MiB or more,
/// or of more than 256 KiB not a multiple of 8 bytes; an rbp saved more than 2 KiB away or
/// not 8-byte aligned) becomes a stop.
pub const fn encode_rule(rule: UnwindRule) -> u32 {
    let rbp = rule.rbp_offset as i64;
    let cfa = rule.cfa_offset as i64;
    let value_mask = (1u32 << CFA_VALUE_BITS) - 1;
    let cfa_field = if fits_signed(cfa, CFA_VALUE_BITS) {
        (cfa as u32 & value_mask) << 1
    } else if cfa % 8 == 0 && fits_signed(cfa / 8, CFA_VALUE_BITS) {
        ((cfa / 8) as u32 & value_mask) << 1 | 1
    } else {
        return kind::STOP as u32;
    };
    if rule.kind as u32 >= (1 << KIND_BITS) || rbp % 8 != 0 || !fits_signed(rbp / 8, RBP_BITS) {
        return kind::STOP as u32;
    }
    let rbp_units = (rbp / 8) as u32 & ((1 << RBP_BITS) - 1);
    rule.kind as u32 | rbp_units << KIND_BITS | cfa_field << (KIND_BITS + RBP_BITS)
}

pub const fn decode_rule(bits: u32) -> UnwindRule {
    let kind = (bits & ((1 << KIND_BITS) - 1)) as u8;
    // Sign-extend each field by shifting it to the top of an i32 and back.
    let rbp_units = (((bits >> KIND_BITS) << (32 - RBP_BITS)) as i32) >> (32 - RBP_BITS);
    let cfa_field = bits >> (KIND_BITS + RBP_BITS);
    let cfa_value = ((cfa_field >> 1) << (32 - CFA_VALUE_BITS)) as i32 >> (32 - CFA_VALUE_BITS);
    let cfa = if cfa_field & 1 != 0 { cfa_value * 8 } else { cfa_value };
    UnwindRule { cfa_offset: cfa, rbp_offset: (rbp_units * 8) as i16, kind, _pad: 0 }
}

/// A table row: from `pc` (relative to the table's base) on, `rule` applies.
pub const fn encode_row(pc: u32, rule: UnwindRule) -> u64 {
    (pc as u64) << 32 | encode_rule(rule) as u64
}

pub const fn row_pc(row: u64) -> u32 {
    (row >> 32) as u32
}

pub const fn row_rule(row: u64) -> UnwindRule {
    decode_rule(row as u32)
}

/// How a file's table lies in its BPF array of u64s: a header, a page index, the rows.
pub mod table {
    /// Element 0: the file's virtual address that row pcs are relative to.
    pub const PC_BASE: u32 = 0;
    /// Element 1: the number of pages in the index (low 32 bits) and of rows (high 32).
    pub const COUNTS: u32 = 1;
    /// Elements 2..2+pages+1: per page of code, the index of the row in effect at its
    /// start (the last row with pc ≤ the page's first pc); one more for the end.
    pub const PAGES: u32 = 2;
    /// Code pages of the index.
    pub const PAGE_SHIFT: u32 = 12;
    /// Rows a search in one page may have to look through: 2^SEARCH_STEPS.
    pub const SEARCH_STEPS: u32 = 16;

    /// The element of row `i` in a table with `pages` pages.
    pub const fn row_element(pages: u32, i: u32) -> u32 {
        PAGES + pages + 1 + i
    }

    pub const fn counts(pages: u32, rows: u32) -> u64 {
        (rows as u64) << 32 | pages as u64
    }
}

/// Finds, among rows `lo..=hi` (sorted by pc), the last row whose pc ≤ `pc`: at most
/// [`table::SEARCH_STEPS`] reads. None when a read fails or the rows do not cover `pc`.
#[inline(always)]
pub fn find_row(mut lo: u32, mut hi: u32, pc: u32, mut row_at: impl FnMut(u32) -> Option<u64>) -> Option<u64> {
    if lo > hi {
        return None;
    }
    // Invariant: row_pc(row lo) ≤ pc (checked first), and the answer lies in lo..=hi.
    let first = row_at(lo)?;
    if row_pc(first) > pc {
        return None;
    }
    let mut best = first;
    for _ in 0..table::SEARCH_STEPS {
        if lo >= hi {
            break;
        }
        let mid = lo + (hi - lo).div_ceil(2);
        let row = row_at(mid)?;
        if row_pc(row) <= pc {
            lo = mid;
            best = row;
        } else {
            hi = mid - 1;
        }
    }
    if lo < hi {
        return None; // more rows in one page than the search may look through
    }
    Some(best)
}

/// Registers of one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
    pub const fn lookup_addr(&self) -> u64 {
        if self.exact { self.ip } else { self.ip.wrapping_sub(1) }
    }
}

/// What one step of a walk found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The caller's registers.
    Caller(Regs),
    /// This was the outermost frame: the stack is whole.
    Outermost,
    /// The walk cannot go on (no rule, an unreadable stack): the stack is truncated.
    Stop,
}

/// From a frame to its caller by `rule`, reading stack words with `read`. A return address
/// of 0 ends the stack; one in the uprobe trampoline page is replaced by `trampoline_for`
/// (what the trampoline stands for; 0: unknown, the walk stops).
#[inline(always)]
pub fn step(regs: Regs, rule: UnwindRule, trampoline_for: u64, mut read: impl FnMut(u64) -> Option<u64>) -> Step {
    let next = match rule.kind {
        kind::OUTERMOST => return Step::Outermost,
        kind::SIGNAL => match (
            read(regs.sp.wrapping_add(sigframe::RIP)),
            read(regs.sp.wrapping_add(sigframe::RSP)),
            read(regs.sp.wrapping_add(sigframe::RBP)),
        ) {
            (Some(ip), Some(sp), Some(bp)) => Regs { ip, sp, bp, exact: true },
            _ => return Step::Stop,
        },
        kind::CFA_SP | kind::CFA_BP | kind::CFA_BP_DEREF => {
            let offset = rule.cfa_offset as i64 as u64;
            let cfa = match rule.kind {
                kind::CFA_SP => regs.sp.wrapping_add(offset),
                kind::CFA_BP => regs.bp.wrapping_add(offset),
                _ => match read(regs.bp.wrapping_add(offset)) {
                    Some(cfa) => cfa,
                    None => return Step::Stop,
                },
            };
            // A frame found from %rbp: %rbp aligned, at or above the stack pointer, the
            // frame within reach: true of every frame pointer, rarely of anything else.
            if rule.kind != kind::CFA_SP
                && (regs.bp & 7 != 0 || regs.bp < regs.sp || cfa <= regs.sp || cfa.wrapping_sub(regs.sp) > MAX_BP_FRAME)
            {
                return Step::Stop;
            }
            let Some(ip) = read(cfa.wrapping_sub(8)) else { return Step::Stop };
            let bp = if rule.rbp_offset != 0 {
                match read(cfa.wrapping_add(rule.rbp_offset as i64 as u64)) {
                    Some(bp) => bp,
                    None => return Step::Stop,
                }
            } else {
                regs.bp
            };
            Regs { ip, sp: cfa, bp, exact: false }
        }
        _ => return Step::Stop,
    };
    if next.ip == 0 {
        // The end of the stack where the CFI says so; found from %rbp (the frame-pointer
        // rule taken where there is no CFI), a zero word proves nothing.
        return if rule.kind == kind::CFA_SP { Step::Outermost } else { Step::Stop };
    }
    if next.ip & !0xfff == UPROBE_TRAMPOLINE_PAGE {
        if trampoline_for == 0 {
            return Step::Stop;
        }
        return Step::Caller(Regs { ip: trampoline_for, ..next });
    }
    Step::Caller(next)
}

/// The data of an LPM-trie key for an address in an address space: the address-space id
/// and the address, big-endian, so prefixes of the key are prefixes of the address.
/// (The trie's key is this preceded by a u32 prefix length; the padding, never inside a
/// prefix, keeps the value after it 8-byte aligned.)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MappingKey {
    pub asid: [u8; 4],
    pub addr: [u8; 8],
    pub _pad: [u8; 4],
}

impl MappingKey {
    /// Bits of the key before the address.
    pub const ASID_BITS: u32 = 32;

    pub const fn new(asid: u32, addr: u64) -> Self {
        Self { asid: asid.to_be_bytes(), addr: addr.to_be_bytes(), _pad: [0; 4] }
    }
}

/// What an address-space range maps: a file's table and the bias that turns an address
/// into the file's virtual address (`vaddr = addr - bias`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MappingValue {
    /// Slot of the file's table in the tables array.
    pub table: u32,
    /// `mapping_flags::*`.
    pub flags: u32,
    pub start: u64,
    pub end: u64,
    pub bias: u64,
}

pub mod mapping_flags {
    /// Executable memory without a file (JIT code): walked by its frame pointer.
    pub const NO_FILE: u32 = 1;
    /// A file without usable call-frame information: walked by its frame pointer.
    pub const NO_TABLE: u32 = 2;
}

/// A file, as the kernel names it: its device (`s_dev`, the kernel's encoding: major << 20
/// | minor) and inode.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FileId {
    pub dev: u32,
    pub _pad: u32,
    pub ino: u64,
}

/// A file whose table is installed, so the probes can add its mappings to an address
/// space themselves, the moment the kernel makes them (exec, mmap), before userspace hears
/// of them: its table's slot and where its code lies in it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FileTable {
    pub slot: u32,
    /// The slot of the interpreter (ld.so) this program asks for; `NO_SLOT` if none.
    pub interp_slot: u32,
    /// The executable segment's virtual address minus its file offset: a mapping of file
    /// offset `o` at address `a` has bias `a - o - delta`.
    pub delta: u64,
    /// The executable segment (its virtual address and size), and the interpreter's.
    pub exec_vaddr: u64,
    pub exec_size: u64,
    pub interp_exec_vaddr: u64,
    pub interp_exec_size: u64,
    /// A second executable segment whose virtual address less its file offset differs
    /// from the first's (libLLVM puts its hot code apart, 2 MiB-aligned, where offset and
    /// address agree): the page-aligned file offset ld.so maps it from, and its delta;
    /// `exec2_offset` 0: none.
    pub exec2_offset: u64,
    pub exec2_delta: u64,
}

impl FileTable {
    /// The delta of the executable segment a mapping of `len` bytes at file offset
    /// `offset` holds: the second segment's for a mapping from its offset (as ld.so maps
    /// it), the first's for one that does not reach the second (any part of the first
    /// segment, or of one with no code); None: a mapping into the second segment from
    /// elsewhere, whose bias the probes cannot tell (userspace installs the range).
    #[inline(always)]
    pub const fn delta_at(&self, offset: u64, len: u64) -> Option<u64> {
        if self.exec2_offset == 0 || offset.saturating_add(len) <= self.exec2_offset {
            Some(self.delta)
        } else if offset == self.exec2_offset {
            Some(self.exec2_delta)
        } else {
            None
        }
    }
}

pub const NO_SLOT: u32 = u32::MAX;

/// Tables (files) a session holds at most: their slots are `0..MAX_TABLES`.
pub const MAX_TABLES: u32 = 4096;

/// Entries of the probes' array of table maps: a table's own map at its slot, and past
/// `MAX_TABLES` the maps installed ahead of need (`SLOT_MAPS` says which one a slot's
/// table was written into): an install into the array waits for an RCU grace period,
/// writing into a map already there does not.
pub const TABLE_MAPS: u32 = 2 * MAX_TABLES;

/// Registers of the frame where the probes' walk could not go on for want of a table (a
/// mapping or file not known yet), and what follows: a copy of the stack from `sp`.
///
/// The walk may have gone on past the frames it had no table for, from an *anchor*: a
/// frame of the same thread's earlier walks that is still on the stack, above the miss
/// (its return address still in its slot). The frames from `resume_at` on are then the
/// anchor's and its callers', and the copy covers the gap below them, not the whole stack:
/// userspace walks the gap once the table is ready and joins the frames walked from the
/// anchor where its walk lands on one of the first of them exactly (same stack pointer,
/// same return address). A stale anchor (a frame returned since whose slot was not
/// overwritten) is off the real stack, and the walk lands on a later one of the first
/// [`RESUME_SPS`] frames walked from it: the first one on the real stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindMiss {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Where the uprobe trampoline stands in for a return address on this stack, and what
    /// it stands for: (slot, return address) pairs, newest first, from the task's return
    /// instances (0, 0 past the last). A walk over the copy that meets the trampoline puts
    /// back the address of its slot, and stops at a slot not here.
    pub returns: [u64; 2 * RETURN_SLOTS],
    /// The address space the frames belong to.
    pub asid: u32,
    /// 1: `ip` is the exact instruction (look the rule up at it), 0: a return address.
    pub exact: u8,
    /// Bit k: the probes' walk from the k-th frame from the anchor found a frame from %rbp
    /// before restoring %rbp from the stack, so it holds only with that frame's %rbp as
    /// `resume_bps[k]` says.
    pub bp_used: u8,
    pub _pad: [u8; 2],
    /// Bytes of user stack copied from `sp` that follow this header.
    pub copy_len: u32,
    /// Frames before the ones walked from an anchor (0: no anchor; the frames end at the
    /// miss).
    pub resume_at: u32,
    /// The stack pointers of the first frames walked from the anchor (0 past the last):
    /// each frame's return address lies just below its stack pointer.
    pub resume_sps: [u64; RESUME_SPS],
    /// Their %rbp as the probes had it.
    pub resume_bps: [u64; RESUME_SPS],
}

/// Return instances of a task read, newest first: for the one an allocator call in
/// progress left, and for a stack copy's trampolines (there are more than one only when
/// return probes fired inside each other: `mmap` inside `malloc`, another tool's).
pub const RETURN_SLOTS: usize = 4;

/// Frames walked from an anchor whose stack pointers go with a copy (the copy reaches the
/// last of them within its slack). Eight, not two: a function whose locals are left
/// unwritten keeps the return addresses of the frames that returned before it was called,
/// several stale anchors in a row; the walk of the gap lands on the first real frame
/// among the eight. `bp_used` has a bit for each.
pub const RESUME_SPS: usize = 8;

/// Slots of each CPU's cache of rules found (the probes' `RULE_CACHE`, direct-mapped,
/// sized for the possible CPUs at load).
pub const RULE_CACHE_SLOTS: u32 = 8192;

/// Bytes of user stack sent with an [`UnwindMiss`] when no anchor bounds the copy.
pub const UNWIND_COPY_BYTES: usize = 16384;

/// Bytes of user stack an [`UnwindMiss`] may carry when it covers the gap below an anchor:
/// one frame can be larger than [`UNWIND_COPY_BYTES`] (Cython's module initializers keep
/// 16.5 KiB of locals; C programs put arrays of any size on the stack), and only the gap's
/// own length is copied, so a longer bound costs nothing where the gaps are short.
pub const UNWIND_ANCHORED_COPY_BYTES: usize = 65536;

/// Mixes one stack word into a running hash (both sides compute it identically).
#[inline(always)]
pub const fn stack_hash_step(h: u64, word: u64) -> u64 {
    (h.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95)
}

/// Mixed into the hash of a stack whose user walk ended at a frame without a rule.
pub const MISS_HASH_MARK: u64 = 0x6d69_7373;

/// Seeds of the user-only and the kernel+user stack hashes.
pub const USER_STACK_SEED: u64 = 0x6d65_6d74_7261_6365;
pub const KERNEL_STACK_SEED: u64 = 0x6b65_726e_656c_2b75;

const _: () = {
    assert!(core::mem::size_of::<UnwindRule>() == 8);
    assert!(core::mem::size_of::<MappingKey>() == 16);
    assert!(core::mem::size_of::<MappingValue>() == 32);
    assert!(core::mem::size_of::<UnwindMiss>() == 40 + 16 * RETURN_SLOTS + 16 * RESUME_SPS && RESUME_SPS <= 8);
    assert!(core::mem::size_of::<FileId>() == 16);
    assert!(core::mem::size_of::<FileTable>() == 64);
};

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{collections::BTreeMap, vec::Vec};

    use super::*;

    fn rule(kind: u8, cfa_offset: i32, rbp_offset: i16) -> UnwindRule {
        UnwindRule { cfa_offset, rbp_offset, kind, _pad: 0 }
    }

    #[test]
    fn rules_survive_the_row_encoding() {
        for r in [
            rule(kind::CFA_SP, 8, 0),
            rule(kind::CFA_SP, 65_560, 0),
            rule(kind::CFA_SP, (1 << 18) - 1, 0),
            rule(kind::CFA_SP, (1 << 18) + 8, 0),
            rule(kind::CFA_SP, 540_080, -16), // rustc's run_compiler closure
            rule(kind::CFA_SP, (2 << 20) - 8, 0),
            rule(kind::CFA_BP, 16, -16),
            rule(kind::CFA_BP_DEREF, -8, -16),
            rule(kind::CFA_BP, 16, 1016),
            rule(kind::CFA_BP, -(1 << 18), -2048),
            rule(kind::CFA_BP, -(2 << 20), 0),
            UnwindRule::OUTERMOST,
            UnwindRule::SIGNAL,
            UnwindRule::STOP,
        ] {
            assert_eq!(row_rule(encode_row(0x1234, r)), r, "{r:?}");
            assert_eq!(row_pc(encode_row(0x1234, r)), 0x1234);
        }
        // What does not fit stops the walk instead of walking wrongly.
        for r in [
            rule(kind::CFA_SP, 2 << 20, 0),
            rule(kind::CFA_SP, (1 << 18) + 4, 0),
            rule(kind::CFA_BP, -(2 << 20) - 8, 0),
            rule(kind::CFA_BP, 16, -12),
            rule(kind::CFA_BP, 16, 2048),
        ] {
            assert_eq!(row_rule(encode_row(0, r)).kind, kind::STOP, "{r:?}");
        }
    }

    #[test]
    fn a_mapping_takes_the_delta_of_the_segment_it_maps() {
        // libLLVM's two executable segments: at 0x449a9a4 (address 0x449b9a4) and at
        // 0x8600000 (address 0x8600000).
        let t = FileTable {
            delta: 0x1000,
            exec_vaddr: 0x449_b9a4,
            exec_size: 0x3ee_331c,
            exec2_offset: 0x860_0000,
            exec2_delta: 0,
            ..Default::default()
        };
        assert_eq!(t.delta_at(0x449_a000, 0x3ee_4000), Some(0x1000));
        // Part of the first segment (a mapping split by mprotect or MAP_FIXED).
        assert_eq!(t.delta_at(0x500_0000, 0x10_0000), Some(0x1000));
        assert_eq!(t.delta_at(0x860_0000, 0x20_0000), Some(0));
        // Reaching into the second segment from elsewhere: its bias is not known here.
        assert_eq!(t.delta_at(0x837_d000, 0x30_0000), None);
        assert_eq!(t.delta_at(0x870_0000, 0x1000), None);
        let one = FileTable { delta: 0, exec_vaddr: 0x1000, exec_size: 0x5000, ..Default::default() };
        assert_eq!((one.delta_at(0x1000, 0x5000), one.delta_at(0x3000, 0x1000)), (Some(0), Some(0)));
    }

    #[test]
    fn the_search_finds_the_row_in_effect() {
        let rows: Vec<u64> = [0u32, 4, 10, 11, 40, 100]
            .iter()
            .enumerate()
            .map(|(i, &pc)| encode_row(pc, rule(kind::CFA_SP, 8 * (i as i32 + 1), 0)))
            .collect();
        let at = |i: u32| rows.get(i as usize).copied();
        let last = rows.len() as u32 - 1;
        for pc in 0..120u32 {
            let want = rows.iter().rev().find(|&&r| row_pc(r) <= pc).copied();
            assert_eq!(find_row(0, last, pc, at), want, "pc {pc}");
        }
        // A sub-range, a failing read, an empty range.
        assert_eq!(find_row(2, 3, 10, at), Some(rows[2]));
        assert_eq!(find_row(2, 3, 9, at), None);
        assert_eq!(find_row(0, last, 50, |_| None), None);
        assert_eq!(find_row(3, 2, 50, at), None);
    }

    #[test]
    fn the_search_is_bounded() {
        let n = 1u32 << table::SEARCH_STEPS;
        let at = |i: u32| Some(encode_row(i, UnwindRule::STOP));
        assert!(find_row(0, n - 1, n / 3, at).is_some());
        assert_eq!(find_row(0, n * 4, n, at), None, "too many rows for the bounded search");
    }

    const BASE: u64 = 0x7fff_0000;

    /// A stack image: (address, value) words.
    fn memory<const N: usize>(words: [(u64, u64); N]) -> impl FnMut(u64) -> Option<u64> {
        let map: BTreeMap<u64, u64> = words.into_iter().collect();
        move |a| map.get(&a).copied()
    }

    #[test]
    fn steps_through_frames_with_and_without_frame_pointers() {
        let mut read = memory([(BASE + 0x20, 0x5000), (BASE + 0x100, BASE + 0x200), (BASE + 0x108, 0x6000)]);
        let leaf = Regs { ip: 0x4100, sp: BASE, bp: BASE + 0x100, exact: false };
        // rsp-based: CFA = rsp + 0x28, return address at CFA − 8.
        let Step::Caller(caller) = step(leaf, rule(kind::CFA_SP, 0x28, 0), 0, &mut read) else { panic!() };
        assert_eq!(caller, Regs { ip: 0x5000, sp: BASE + 0x28, bp: BASE + 0x100, exact: false });
        // rbp-based with rbp saved at CFA − 16.
        let Step::Caller(up) = step(caller, rule(kind::CFA_BP, 16, -16), 0, &mut read) else { panic!() };
        assert_eq!(up, Regs { ip: 0x6000, sp: BASE + 0x110, bp: BASE + 0x200, exact: false });
        assert_eq!(step(up, UnwindRule::OUTERMOST, 0, &mut read), Step::Outermost);
        assert_eq!(step(up, UnwindRule::STOP, 0, &mut read), Step::Stop);
        // An unreadable word stops the walk.
        assert_eq!(step(up, rule(kind::CFA_SP, 0x1000, 0), 0, &mut read), Step::Stop);
    }

    #[test]
    fn steps_through_signal_frames_realigned_frames_and_the_trampoline() {
        let sp = BASE;
        let mut read = memory([
            (sp + sigframe::RIP, 0x6000),
            (sp + sigframe::RSP, BASE + 0x300),
            (sp + sigframe::RBP, BASE + 0x400),
            (BASE + 0x400 - 8, BASE + 0x500), // DRAP: CFA = *(rbp − 8)
            (BASE + 0x500 - 8, UPROBE_TRAMPOLINE_PAGE + 0x10),
            (BASE + 0x500 - 16, BASE + 0x600),
        ]);
        let r = Regs { ip: 0x5000, sp, bp: 0, exact: false };
        let Step::Caller(interrupted) = step(r, UnwindRule::SIGNAL, 0, &mut read) else { panic!() };
        assert_eq!(interrupted, Regs { ip: 0x6000, sp: BASE + 0x300, bp: BASE + 0x400, exact: true });
        assert_eq!(interrupted.lookup_addr(), 0x6000, "an interrupted instruction is looked up exactly");
        let drap = rule(kind::CFA_BP_DEREF, -8, -16);
        // The return address is the trampoline's: what it stands for takes its place.
        let Step::Caller(caller) = step(interrupted, drap, 0x7777, &mut read) else { panic!() };
        assert_eq!(caller, Regs { ip: 0x7777, sp: BASE + 0x500, bp: BASE + 0x600, exact: false });
        assert_eq!(caller.lookup_addr(), 0x7776);
        assert_eq!(step(interrupted, drap, 0, &mut read), Step::Stop, "an unknown trampoline stops");
        // A zero return address is the end of the stack.
        let mut zero = memory([(BASE + 8, 0)]);
        assert_eq!(step(Regs { sp: BASE, ..r }, rule(kind::CFA_SP, 16, 0), 0, &mut zero), Step::Outermost);
    }

    /// Code no call-frame information describes is walked by its frame pointer, when %rbp
    /// looks like one: aligned, above the stack pointer, within a stack's reach.
    #[test]
    fn code_without_call_frame_information_is_walked_by_its_frame_pointer() {
        let jit = Regs { ip: 0x4100, sp: BASE, bp: BASE + 0x100, exact: false };
        let fp = UnwindRule::FRAME_POINTER;
        // A frame at `bp`: the caller's %rbp, then a return address.
        let frame_at = |bp: u64| {
            let words: BTreeMap<u64, u64> = [(bp, bp + 0x100), (bp + 8, 0x6000)].into_iter().collect();
            move |a: u64| words.get(&a).copied()
        };
        let Step::Caller(caller) = step(jit, fp, 0, frame_at(BASE + 0x100)) else { panic!() };
        assert_eq!(caller, Regs { ip: 0x6000, sp: BASE + 0x110, bp: BASE + 0x200, exact: false });
        // %rbp below the stack pointer, unaligned, or further than a stack reaches (another
        // thread's, the parent's in a thread just cloned): no frame, whatever lies there.
        for bp in [BASE - 0x100, BASE - 8, BASE + 0x101, BASE + MAX_BP_FRAME] {
            assert_eq!(step(Regs { bp, ..jit }, fp, 0, frame_at(bp)), Step::Stop, "{bp:#x}");
        }
        // A zero word where the return address would be ends nothing: only the CFI says
        // where a stack ends.
        let zero = |a: u64| (a == BASE + 0x100 || a == BASE + 0x108).then_some(0);
        assert_eq!(step(jit, fp, 0, zero), Step::Stop);
    }

    #[test]
    fn mapping_keys_are_big_endian_prefixes() {
        let k = MappingKey::new(0x0102_0304, 0x7f00_1234_5678);
        assert_eq!(k.asid, [1, 2, 3, 4]);
        assert_eq!(k.addr, [0, 0, 0x7f, 0, 0x12, 0x34, 0x56, 0x78]);
    }
}
