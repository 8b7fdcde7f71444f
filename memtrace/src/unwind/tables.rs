//! A module's call-frame information, read once: `.eh_frame` (and `.debug_frame` for code
//! it does not cover), indexed by address, and turned into the [`UnwindRule`] the probes
//! walk with for any address of the module.
use std::{fs::File, path::Path, sync::Arc};

use anyhow::{Context as _, Result};
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianArcSlice, Reader as _, Register, RegisterRule,
    RunTimeEndian, UnwindContext, UnwindSection, X86_64,
};
use iced_x86::{Decoder, DecoderOptions, FlowControl, Instruction};
use memmap2::Mmap;
use memtrace_common::{UnwindRule, unwind_kind};
use object::{Object as _, ObjectSection as _, ObjectSegment as _};

type Slice = EndianArcSlice<RunTimeEndian>;

/// The parts of a row of the unwind table the probes can follow, as found in the CFI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cfa {
    Sp(i64),
    Bp(i64),
    /// `DW_OP_breg6 N; DW_OP_deref`: a realigned frame's CFA saved below rbp.
    BpDeref(i64),
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// Not mentioned, or same value: the register is unchanged in the caller.
    Unchanged,
    /// Saved at CFA + N.
    At(i64),
    /// The caller has no value (the return address of the outermost frame).
    Undefined,
    /// Anything else (another register, an expression).
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSummary {
    pub signal_frame: bool,
    pub cfa: Cfa,
    pub ra: Saved,
    pub rbp: Saved,
}

const STOP: UnwindRule = UnwindRule { cfa_offset: 0, rbp_offset: 0, kind: unwind_kind::STOP, _pad: 0 };

/// The rule the probes can walk for a row; [`unwind_kind::STOP`] for what they cannot.
pub fn rule_for(row: RowSummary) -> UnwindRule {
    if row.signal_frame {
        return UnwindRule { kind: unwind_kind::SIGNAL, ..STOP };
    }
    match row.ra {
        Saved::Undefined => return UnwindRule { kind: unwind_kind::OUTERMOST, ..STOP },
        Saved::At(-8) => {}
        _ => return STOP,
    }
    let (kind, offset) = match row.cfa {
        Cfa::Sp(o) => (unwind_kind::CFA_SP, o),
        Cfa::Bp(o) => (unwind_kind::CFA_BP, o),
        Cfa::BpDeref(o) => (unwind_kind::CFA_BP_DEREF, o),
        Cfa::Other => return STOP,
    };
    let Ok(cfa_offset) = i32::try_from(offset) else { return STOP };
    let rbp_offset = match row.rbp {
        Saved::Unchanged => 0,
        Saved::At(o) => match i16::try_from(o) {
            Ok(o) if o != 0 => o,
            _ => return STOP,
        },
        Saved::Undefined | Saved::Other => return STOP,
    };
    UnwindRule { cfa_offset, rbp_offset, kind, _pad: 0 }
}

/// Where a module's loadable segments sit: file offset → virtual address.
#[derive(Debug, Clone, Copy)]
struct Segment {
    file_offset: u64,
    vaddr: u64,
    file_size: u64,
}

/// The address range one FDE covers.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: u64,
    end: u64,
    offset: usize,
    in_debug_frame: bool,
}

/// Code this far past the ELF entry point, without call-frame information, is the
/// entry code (ld.so's `_start` has none): the outermost frame.
const ENTRY_CODE_BYTES: u64 = 64;

pub struct ModuleUnwind {
    /// The file, for its code (call sites are found by decoding it).
    file: Mmap,
    segments: Vec<Segment>,
    entry: u64,
    eh_frame: Option<EhFrame<Slice>>,
    debug_frame: Option<DebugFrame<Slice>>,
    bases: BaseAddresses,
    /// Sorted by start; `.eh_frame` spans before `.debug_frame` ones for the same start.
    spans: Vec<Span>,
}

fn arc_slice(data: &[u8], endian: RunTimeEndian) -> Slice {
    EndianArcSlice::new(Arc::from(data), endian)
}

impl ModuleUnwind {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: read-only private mapping, kept for the module's code; a concurrent
        // truncation of the file could fault, the risk every ELF reader (ld.so too) takes.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        let elf = object::File::parse(&*map).with_context(|| format!("{} is not an ELF file", path.display()))?;
        let endian = if elf.is_little_endian() { RunTimeEndian::Little } else { RunTimeEndian::Big };
        let segments = elf
            .segments()
            .map(|s| {
                let (file_offset, file_size) = s.file_range();
                Segment { file_offset, vaddr: s.address(), file_size }
            })
            .collect();
        let mut bases = BaseAddresses::default();
        if let Some(text) = elf.section_by_name(".text") {
            bases = bases.set_text(text.address());
        }
        if let Some(got) = elf.section_by_name(".got") {
            bases = bases.set_got(got.address());
        }
        if let Some(hdr) = elf.section_by_name(".eh_frame_hdr") {
            bases = bases.set_eh_frame_hdr(hdr.address());
        }
        let mut eh_frame = None;
        if let Some(section) = elf.section_by_name(".eh_frame")
            && let Ok(data) = section.uncompressed_data()
        {
            bases = bases.set_eh_frame(section.address());
            let mut frame = EhFrame::from(arc_slice(&data, endian));
            frame.set_address_size(8);
            eh_frame = Some(frame);
        }
        let mut debug_frame = None;
        if let Some(section) = elf.section_by_name(".debug_frame")
            && let Ok(data) = section.uncompressed_data()
        {
            let mut frame = DebugFrame::from(arc_slice(&data, endian));
            frame.set_address_size(8);
            debug_frame = Some(frame);
        }
        let entry = elf.entry();
        drop(elf);
        let mut module = Self { file: map, segments, entry, eh_frame, debug_frame, bases, spans: Vec::new() };
        module.index();
        Ok(module)
    }

    /// Lists the address range of every FDE. Parsing stops at the first malformed entry;
    /// what came before is kept.
    fn index(&mut self) {
        let mut spans = Vec::new();
        if let Some(eh) = &self.eh_frame {
            fde_spans(eh, &self.bases, false, &mut spans);
        }
        if let Some(debug) = &self.debug_frame {
            fde_spans(debug, &self.bases, true, &mut spans);
        }
        spans.sort_by_key(|s| (s.start, s.in_debug_frame));
        self.spans = spans;
    }

    pub fn fde_count(&self) -> usize {
        self.spans.len()
    }

    /// The address ranges of the module's functions (one per FDE).
    pub fn functions(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.spans.iter().map(|s| (s.start, s.end))
    }

    /// The function (FDE range) containing `vaddr`.
    pub fn function_at(&self, vaddr: u64) -> Option<(u64, u64)> {
        let end = self.spans.partition_point(|s| s.start <= vaddr);
        self.spans[..end].iter().rev().take(4).find(|s| vaddr < s.end).map(|s| (s.start, s.end))
    }

    /// The return addresses of the calls in `[start, end)`: where the callers' frames of
    /// any stack through this code will be looked up (minus one).
    pub fn return_addresses(&self, start: u64, end: u64) -> Vec<u64> {
        let Some(code) = self.code(start, end) else { return Vec::new() };
        let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
        let mut instr = Instruction::default();
        let mut out = Vec::new();
        while decoder.can_decode() {
            decoder.decode_out(&mut instr);
            if matches!(instr.flow_control(), FlowControl::Call | FlowControl::IndirectCall) {
                out.push(instr.next_ip());
            }
        }
        out
    }

    /// The bytes of `[start, end)` (virtual addresses within one loadable segment).
    fn code(&self, start: u64, end: u64) -> Option<&[u8]> {
        let seg = self.segments.iter().find(|s| (s.vaddr..s.vaddr + s.file_size).contains(&start))?;
        let from = usize::try_from(start - seg.vaddr + seg.file_offset).ok()?;
        let to = usize::try_from(end.min(seg.vaddr + seg.file_size) - seg.vaddr + seg.file_offset).ok()?;
        self.file.get(from..to)
    }

    /// The virtual address (as in the ELF file) of a file offset in a loadable segment.
    pub fn vaddr_of_file_offset(&self, offset: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|s| s.file_size > 0 && (s.file_offset..s.file_offset + s.file_size).contains(&offset))
            .map(|s| offset - s.file_offset + s.vaddr)
    }

    /// The rule for the instruction at `vaddr` (an ELF virtual address of this module).
    pub fn rule_at(&self, vaddr: u64, ctx: &mut UnwindContext<usize>) -> UnwindRule {
        let end = self.spans.partition_point(|s| s.start <= vaddr);
        // FDEs do not overlap in practice; look at the few that start at or before vaddr.
        for span in self.spans[..end].iter().rev().take(4) {
            if vaddr >= span.end {
                continue;
            }
            let row = if span.in_debug_frame {
                self.debug_frame.as_ref().and_then(|s| row_summary(s, &self.bases, span.offset, vaddr, ctx))
            } else {
                self.eh_frame.as_ref().and_then(|s| row_summary(s, &self.bases, span.offset, vaddr, ctx))
            };
            if let Some(row) = row {
                return rule_for(row);
            }
        }
        if self.entry != 0 && (self.entry..self.entry + ENTRY_CODE_BYTES).contains(&vaddr) {
            return UnwindRule { kind: unwind_kind::OUTERMOST, ..STOP };
        }
        STOP
    }
}

fn fde_spans<S: UnwindSection<Slice>>(section: &S, bases: &BaseAddresses, in_debug_frame: bool, out: &mut Vec<Span>) {
    let mut entries = section.entries(bases);
    while let Ok(Some(entry)) = entries.next() {
        if let CieOrFde::Fde(partial) = entry
            && let Ok(fde) = partial.parse(S::cie_from_offset)
        {
            out.push(Span {
                start: fde.initial_address(),
                end: fde.end_address(),
                offset: fde.offset(),
                in_debug_frame,
            });
        }
    }
}

fn row_summary<S: UnwindSection<Slice>>(
    section: &S,
    bases: &BaseAddresses,
    offset: usize,
    vaddr: u64,
    ctx: &mut UnwindContext<usize>,
) -> Option<RowSummary> {
    let fde = section.fde_from_offset(bases, offset.into(), S::cie_from_offset).ok()?;
    let signal_frame = fde.is_signal_trampoline();
    let row = fde.unwind_info_for_address(section, bases, ctx, vaddr).ok()?;
    let cfa = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => Cfa::Sp(*offset),
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => Cfa::Bp(*offset),
        CfaRule::RegisterAndOffset { .. } => Cfa::Other,
        CfaRule::Expression(expr) => {
            let bytes = expr.get(section).ok()?.0.to_slice().ok()?.into_owned();
            bp_deref_offset(&bytes).map_or(Cfa::Other, Cfa::BpDeref)
        }
    };
    let saved = |reg: Register| match row.register(reg) {
        None | Some(RegisterRule::SameValue) => Saved::Unchanged,
        Some(RegisterRule::Undefined) => Saved::Undefined,
        Some(RegisterRule::Offset(o)) => Saved::At(o),
        Some(_) => Saved::Other,
    };
    let ra = match row.register(X86_64::RA) {
        // The return address column is always described; absent means undefined.
        None => Saved::Undefined,
        _ => saved(X86_64::RA),
    };
    Some(RowSummary { signal_frame, cfa, ra, rbp: saved(X86_64::RBP) })
}

/// N of the expression `DW_OP_breg6 (rbp) N; DW_OP_deref`.
pub fn bp_deref_offset(expr: &[u8]) -> Option<i64> {
    const DW_OP_BREG6: u8 = 0x76;
    const DW_OP_DEREF: u8 = 0x06;
    let (&op, rest) = expr.split_first()?;
    if op != DW_OP_BREG6 {
        return None;
    }
    let (value, used) = sleb128(rest)?;
    (rest.get(used..) == Some(&[DW_OP_DEREF][..])).then_some(value)
}

fn sleb128(bytes: &[u8]) -> Option<(i64, usize)> {
    let mut value: i64 = 0;
    let mut shift = 0u32;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        value |= i64::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            if shift < 64 && b & 0x40 != 0 {
                value |= -1i64 << shift;
            }
            return Some((value, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs::Maps;

    fn row(cfa: Cfa, ra: Saved, rbp: Saved) -> RowSummary {
        RowSummary { signal_frame: false, cfa, ra, rbp }
    }

    #[test]
    fn rows_become_rules_the_probes_can_walk() {
        let r = rule_for(row(Cfa::Sp(8), Saved::At(-8), Saved::Unchanged));
        assert_eq!((r.kind, r.cfa_offset, r.rbp_offset), (unwind_kind::CFA_SP, 8, 0));
        let r = rule_for(row(Cfa::Bp(16), Saved::At(-8), Saved::At(-16)));
        assert_eq!((r.kind, r.cfa_offset, r.rbp_offset), (unwind_kind::CFA_BP, 16, -16));
        let r = rule_for(row(Cfa::BpDeref(-8), Saved::At(-8), Saved::At(-16)));
        assert_eq!((r.kind, r.cfa_offset), (unwind_kind::CFA_BP_DEREF, -8));
        assert_eq!(rule_for(row(Cfa::Sp(8), Saved::Undefined, Saved::Unchanged)).kind, unwind_kind::OUTERMOST);
        assert_eq!(
            rule_for(RowSummary { signal_frame: true, ..row(Cfa::Other, Saved::Other, Saved::Other) }).kind,
            unwind_kind::SIGNAL
        );
        // What the probes cannot follow stops the walk rather than guessing.
        for r in [
            row(Cfa::Other, Saved::At(-8), Saved::Unchanged),
            row(Cfa::Sp(8), Saved::At(-16), Saved::Unchanged),
            row(Cfa::Sp(8), Saved::Other, Saved::Unchanged),
            row(Cfa::Sp(8), Saved::At(-8), Saved::Other),
            row(Cfa::Sp(1 << 40), Saved::At(-8), Saved::Unchanged),
            row(Cfa::Sp(8), Saved::At(-8), Saved::At(1 << 20)),
        ] {
            assert_eq!(rule_for(r).kind, unwind_kind::STOP, "{r:?}");
        }
    }

    #[test]
    fn realigned_frame_expressions_are_recognised() {
        assert_eq!(bp_deref_offset(&[0x76, 0x78, 0x06]), Some(-8));
        assert_eq!(bp_deref_offset(&[0x76, 0x10, 0x06]), Some(16));
        assert_eq!(bp_deref_offset(&[0x76, 0x78]), None);
        assert_eq!(bp_deref_offset(&[0x77, 0x08, 0x06]), None);
        assert_eq!(bp_deref_offset(&[0x76, 0x78, 0x06, 0x23]), None);
        assert_eq!(bp_deref_offset(&[]), None);
    }

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(marker as *const () as u64)
    }

    /// Our own executable's rules: a function's first instruction has CFA = rsp + 8.
    #[test]
    fn a_function_entry_has_the_call_frame_of_a_call() {
        let maps = Maps::read_self().unwrap();
        let ip = marker();
        let m = maps.find(ip).unwrap();
        let module = ModuleUnwind::open(&m.path).unwrap();
        assert!(module.fde_count() > 100);
        let vaddr = module.vaddr_of_file_offset(m.file_offset(ip)).unwrap();
        let mut ctx = UnwindContext::new();
        let rule = module.rule_at(vaddr, &mut ctx);
        assert_eq!((rule.kind, rule.cfa_offset, rule.rbp_offset), (unwind_kind::CFA_SP, 8, 0), "{rule:?}");
        assert_eq!(module.rule_at(u64::MAX - 1, &mut ctx).kind, unwind_kind::STOP);
        // The function has one call (to black_box's inner or to nothing when inlined): every
        // return address found lies inside it, right after a call instruction.
        let (start, end) = module.function_at(vaddr).unwrap();
        assert_eq!(start, vaddr);
        for ra in module.return_addresses(start, end) {
            assert!(ra > start && ra <= end, "{ra:x} outside {start:x}..{end:x}");
        }
    }

    #[test]
    fn call_sites_are_found_by_decoding_the_code() {
        // The test harness's main calls at least a few functions.
        let maps = Maps::read_self().unwrap();
        let ip = marker();
        let m = maps.find(ip).unwrap();
        let module = ModuleUnwind::open(&m.path).unwrap();
        let calls: usize = module.functions().map(|(s, e)| module.return_addresses(s, e).len()).sum();
        assert!(calls > 1000, "{calls} call sites in the test binary");
    }
}
