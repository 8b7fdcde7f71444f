//! Where in a function to put its uprobe. The kernel emulates a few x86 instructions at a
//! probe (nops, `push reg`, relative jumps, calls and conditional jumps); any other
//! instruction is single-stepped out of line, a second trap that costs microseconds.
//! glibc's `free` starts with `test %rdi,%rdi`, so probing its entry is several times
//! dearer than probing the `je` that follows. This module decodes the function and picks
//! the first emulated instruction reached on every path, provided nothing before it writes
//! the stack pointer (a return probe must still find the return address at `%rsp`, and the
//! nesting check compares stack pointers), an argument register the probe reads, or
//! branches — and nothing in the function jumps back into the skipped prefix. When unsure,
//! the entry.
use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpAccess, Register};

/// How far into a function a probe may move.
const MAX_PREFIX_INSTRUCTIONS: usize = 4;

/// The multi-byte nops the kernel recognises (`x86_nops`, P6 forms), and the one-byte nop.
const NOPS: &[&[u8]] = &[
    &[0x90],
    &[0x66, 0x90],
    &[0x0f, 0x1f, 0x00],
    &[0x0f, 0x1f, 0x40, 0x00],
    &[0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00],
    &[0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00],
];

/// Whether the kernel executes the instruction `bytes` at a probe without single-stepping.
pub fn is_emulated(bytes: &[u8]) -> bool {
    match bytes {
        b if NOPS.contains(&b) => true,
        // push r64 (rax..rdi), and r8..r15 with the one REX prefix the kernel accepts.
        [0x50..=0x57] | [0x41, 0x50..=0x57] => true,
        // jmp rel8/rel32, call rel32, jcc rel8, jcc rel32 (no operand-size prefix).
        [0xeb, _] | [0xe9, _, _, _, _] | [0xe8, _, _, _, _] => true,
        [0x70..=0x7f, _] => true,
        [0x0f, 0x80..=0x8f, _, _, _, _] => true,
        _ => false,
    }
}

/// The probe offset (from the function start) for `code`, the function's bytes (`len` of
/// them belong to the function when known), when the probe reads the registers `args`.
pub fn probe_offset(code: &[u8], len: Option<usize>, args: &[Register]) -> u64 {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut instr = Instruction::default();
    let mut offset = 0usize;
    for _ in 0..=MAX_PREFIX_INSTRUCTIONS {
        if !decoder.can_decode() {
            return 0;
        }
        decoder.decode_out(&mut instr);
        if instr.is_invalid() {
            return 0;
        }
        let bytes = &code[offset..offset + instr.len()];
        if is_emulated(bytes) {
            return if offset == 0 || !jumped_into(code, len, offset) { offset as u64 } else { 0 };
        }
        // This instruction would be skipped: it must leave the probe's view unchanged.
        if instr.flow_control() != FlowControl::Next {
            return 0;
        }
        let writes = info.info(&instr).used_registers().iter().any(|u| {
            matches!(u.access(), OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite)
                && (u.register().full_register() == Register::RSP || args.contains(&u.register().full_register()))
        });
        if writes {
            return 0;
        }
        offset += instr.len();
    }
    0
}

/// Whether any branch of the function lands inside (0, offset]: such a path would skip
/// the probe. Without the function's length it cannot be ruled out.
fn jumped_into(code: &[u8], len: Option<usize>, offset: usize) -> bool {
    let Some(len) = len else { return true };
    let body = &code[..len.min(code.len())];
    if body.len() < len {
        return true; // not all of the function is at hand
    }
    let mut decoder = Decoder::with_ip(64, body, 0, DecoderOptions::NONE);
    let mut instr = Instruction::default();
    while decoder.can_decode() {
        decoder.decode_out(&mut instr);
        if matches!(
            instr.flow_control(),
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch | FlowControl::Call
        ) {
            let target = instr.near_branch_target();
            if target > 0 && target <= offset as u64 {
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_emulated_instructions() {
        assert!(is_emulated(&[0x41, 0x54])); // push %r12
        assert!(is_emulated(&[0x55])); // push %rbp
        assert!(is_emulated(&[0x74, 0x10])); // je
        assert!(is_emulated(&[0x0f, 0x84, 0, 0, 0, 0])); // je rel32
        assert!(is_emulated(&[0xe9, 1, 2, 3, 4])); // jmp
        assert!(!is_emulated(&[0x48, 0x85, 0xff])); // test %rdi,%rdi
        assert!(!is_emulated(&[0x48, 0x50])); // push with REX.W: single-stepped
        assert!(!is_emulated(&[0xf3, 0x0f, 0x1e, 0xfa])); // endbr64
        assert!(!is_emulated(&[0x66, 0x2e, 0x0f, 0x1f, 0x84, 0, 0, 0, 0, 0])); // nopw %cs:...
    }

    #[test]
    fn glibc_free_moves_past_its_test() {
        // test %rdi,%rdi; je +0xc2; push %rbp; ...; ret
        let mut code = vec![0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55];
        code.resize(0xc8, 0x90);
        code.push(0xc3);
        assert_eq!(probe_offset(&code, Some(code.len()), &[Register::RDI]), 3);
    }

    #[test]
    fn stays_at_the_entry_when_an_argument_or_the_stack_pointer_changes() {
        // mov %rsi,%rax; mul %rdx (writes rdx); mov %rax,%rsi; jmp ...
        let code = [0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe2, 0x48, 0x89, 0xc6, 0xeb, 0x00];
        assert_eq!(probe_offset(&code, Some(code.len()), &[Register::RDI, Register::RSI, Register::RDX]), 0);
        // sub $8,%rsp; push %rbx
        let code = [0x48, 0x83, 0xec, 0x08, 0x53];
        assert_eq!(probe_offset(&code, Some(code.len()), &[Register::RDI]), 0);
        // mov $0xb,%eax; syscall: nothing emulated within reach
        let code = [0xb8, 0x0b, 0, 0, 0, 0x0f, 0x05, 0xc3];
        assert_eq!(probe_offset(&code, Some(code.len()), &[Register::RDI]), 0);
    }

    #[test]
    fn stays_at_the_entry_when_a_branch_lands_in_the_skipped_prefix() {
        // test %rdi,%rdi; je +2; nop; nop; jmp back to +3 (the je)
        let code = [0x48, 0x85, 0xff, 0x74, 0x02, 0x90, 0x90, 0xeb, 0xfa];
        assert_eq!(probe_offset(&code, Some(code.len()), &[Register::RDI]), 0);
        let safe = [0x48, 0x85, 0xff, 0x74, 0x02, 0x90, 0x90, 0xc3];
        assert_eq!(probe_offset(&safe, Some(safe.len()), &[Register::RDI]), 3);
        assert_eq!(probe_offset(&safe, None, &[Register::RDI]), 0, "unknown length: entry");
    }
}
