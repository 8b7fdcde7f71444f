//! Reading a file's call-frame information — `.eh_frame`, and `.debug_frame` for code it
//! does not cover — into the rows of its unwind table: for every FDE, each row of its CFA
//! program turned into the [`UnwindRule`] the probes can follow (or a stop), plus the
//! frame-pointer rule where no FDE covers the code. Also where the file's loadable segments sit, so a mapping's
//! file offset can be turned into the file's virtual addresses.
use std::{fs::File, path::Path, sync::Arc};

use anyhow::{Context as _, Result};
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EndianArcSlice, Reader as _, Register, RegisterRule,
    RunTimeEndian, Section as _, UnwindContext, UnwindSection, UnwindTableRow, X86_64,
};
use memmap2::Mmap;
use memtrace_common::{UnwindRule, unwind::kind};
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

/// The rule the probes can walk for a row; [`kind::STOP`] for what they cannot.
pub fn rule_for(row: RowSummary) -> UnwindRule {
    if row.signal_frame {
        return UnwindRule::SIGNAL;
    }
    match row.ra {
        Saved::Undefined => return UnwindRule::OUTERMOST,
        Saved::At(-8) => {}
        _ => return UnwindRule::STOP,
    }
    let (kind, offset) = match row.cfa {
        Cfa::Sp(o) => (kind::CFA_SP, o),
        Cfa::Bp(o) => (kind::CFA_BP, o),
        Cfa::BpDeref(o) => (kind::CFA_BP_DEREF, o),
        Cfa::Other => return UnwindRule::STOP,
    };
    let Ok(cfa_offset) = i32::try_from(offset) else { return UnwindRule::STOP };
    let rbp_offset = match row.rbp {
        Saved::Unchanged => 0,
        Saved::At(o) => match i16::try_from(o) {
            Ok(o) if o != 0 => o,
            _ => return UnwindRule::STOP,
        },
        Saved::Undefined | Saved::Other => return UnwindRule::STOP,
    };
    UnwindRule { cfa_offset, rbp_offset, kind, _pad: 0 }
}

/// Where a loadable segment sits: file offset → virtual address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub file_offset: u64,
    pub vaddr: u64,
    pub file_size: u64,
    /// `PF_X`: the segment holds code.
    pub executable: bool,
}

/// The loadable segments of a parsed ELF file.
pub fn segments_of(elf: &object::File<'_>) -> Vec<Segment> {
    use object::read::elf::ProgramHeader as _;
    let flags_of = |index: usize| -> bool {
        match elf {
            object::File::Elf64(f) => f
                .elf_program_headers()
                .iter()
                .filter(|ph| ph.p_type(f.endian()) == object::elf::PT_LOAD)
                .nth(index)
                .is_some_and(|ph| ph.p_flags(f.endian()) & object::elf::PF_X != 0),
            _ => false,
        }
    };
    elf.segments()
        .enumerate()
        .map(|(i, s)| {
            let (file_offset, file_size) = s.file_range();
            Segment { file_offset, vaddr: s.address(), file_size, executable: flags_of(i) }
        })
        .collect()
}

/// The virtual address (as in the ELF file) of a file offset in a loadable segment. The
/// offset may lie in the page the segment starts in (mappings start at page boundaries, a
/// segment need not); where two segments share that page, the executable one is meant.
pub fn vaddr_of_file_offset(segments: &[Segment], offset: u64) -> Option<u64> {
    let holds =
        |s: &&Segment| s.file_size > 0 && (s.file_offset & !0xfff..s.file_offset + s.file_size).contains(&offset);
    segments
        .iter()
        .filter(holds)
        .max_by_key(|s| (s.executable, s.file_offset))
        .map(|s| (offset + s.vaddr).wrapping_sub(s.file_offset))
}

/// Code this far past the ELF entry point, without call-frame information, is the entry
/// code (ld.so's `_start` has none): the outermost frame.
const ENTRY_CODE_BYTES: u64 = 64;

/// A row of a file's table before packing: from `pc` (a virtual address of the file) on,
/// `rule` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub pc: u64,
    pub rule: UnwindRule,
}

/// A file's call-frame information and segments.
pub struct Cfi {
    pub segments: Vec<Segment>,
    entry: u64,
    eh_frame: Option<EhFrame<Slice>>,
    debug_frame: Option<DebugFrame<Slice>>,
    bases: BaseAddresses,
}

fn arc_slice(data: &[u8], endian: RunTimeEndian) -> Slice {
    EndianArcSlice::new(Arc::from(data), endian)
}

impl Cfi {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: read-only private mapping for the time the file is parsed; a concurrent
        // truncation could fault, the risk every ELF reader (ld.so too) takes.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        Self::parse(&map).with_context(|| format!("reading the call-frame information of {}", path.display()))
    }

    pub fn parse(data: &[u8]) -> Result<Self> {
        let elf = object::File::parse(data).context("not an ELF file")?;
        let endian = if elf.is_little_endian() { RunTimeEndian::Little } else { RunTimeEndian::Big };
        let segments = segments_of(&elf);
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
        Ok(Self { segments, entry: elf.entry(), eh_frame, debug_frame, bases })
    }

    /// Every row of the file's table, sorted by pc, without two consecutive rows of the
    /// same rule: the FDEs' rows, the frame-pointer rule where no FDE covers code
    /// ([`UnwindRule::FRAME_POINTER`]), and the entry code as
    /// the outermost frame when no FDE describes it. Parsing stops at the first malformed
    /// entry of a section; what came before is kept.
    pub fn rows(&self) -> Vec<Row> {
        // Every FDE row and FDE end, ranked (`ranked`), sorted and merged in place: a big
        // library has millions (libtriton 2.35 M after merging), and a vector of
        // (pc, rank, rule) triples of 24 bytes, its merged copy and the packed table were
        // ~190 MB at once, twice that with two libraries built side by side. Room for a
        // row per two bytes of CFI is reserved (more than they take: untouched room costs
        // no memory), so that the vector does not move as it grows.
        let cfi_bytes = self.eh_frame.as_ref().map_or(0, |s| s.reader().len())
            + self.debug_frame.as_ref().map_or(0, |s| s.reader().len());
        // (Asked for, not required: with strict overcommit or a limit on address space
        // the room may be refused, and the vector grows as it must.)
        let mut rows: Vec<Row> = Vec::new();
        let _ = rows.try_reserve((cfi_bytes / 2 + 2).min(MAX_RESERVED_ROWS));
        let mut ctx = Box::new(UnwindContext::new());
        let mut covered: Vec<(u64, u64)> = Vec::new();
        if let Some(eh) = &self.eh_frame {
            fde_rows(eh, &self.bases, &mut ctx, &[], &mut rows, &mut covered);
        }
        if let Some(debug) = &self.debug_frame {
            covered.sort_unstable();
            let eh_spans = std::mem::take(&mut covered);
            fde_rows(debug, &self.bases, &mut ctx, &eh_spans, &mut rows, &mut covered);
            covered.extend(eh_spans);
        }
        if self.entry != 0 && !covered.iter().any(|&(s, e)| (s..e).contains(&self.entry)) {
            rows.push(ranked(self.entry, FDE_ROW, UnwindRule::OUTERMOST));
            rows.push(ranked(self.entry + ENTRY_CODE_BYTES, FDE_END, UnwindRule::FRAME_POINTER));
        }
        rows.sort_unstable_by_key(|r| (r.pc, r.rule._pad));
        let mut kept = 0;
        for i in 0..rows.len() {
            let Row { pc, mut rule } = rows[i];
            // Of several rows at one pc the last (highest rank) wins.
            if rows.get(i + 1).is_some_and(|next| next.pc == pc) {
                continue;
            }
            rule._pad = 0;
            if kept > 0 && rows[kept - 1].rule == rule {
                continue;
            }
            rows[kept] = Row { pc, rule };
            kept += 1;
        }
        rows.truncate(kept);
        rows
    }
}

/// Rows reserved at most ahead of reading the CFI (512 MiB of room).
const MAX_RESERVED_ROWS: usize = 1 << 25;

/// The rank of a row at a pc where another FDE ends: an FDE's row wins over the stop the
/// end of the FDE before it leaves.
const FDE_END: u8 = 0;
const FDE_ROW: u8 = 1;

/// A row before merging, its rank in the rule's spare byte (reset when merged).
fn ranked(pc: u64, rank: u8, mut rule: UnwindRule) -> Row {
    rule._pad = rank;
    Row { pc, rule }
}

/// Appends the rows of every FDE of `section` that does not overlap `skip` (sorted spans a
/// section read before covers), and records the spans it covered.
fn fde_rows<S: UnwindSection<Slice>>(
    section: &S,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    skip: &[(u64, u64)],
    out: &mut Vec<Row>,
    covered: &mut Vec<(u64, u64)>,
) {
    let mut entries = section.entries(bases);
    while let Ok(Some(entry)) = entries.next() {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(fde) = partial.parse(S::cie_from_offset) else { continue };
        let (start, end) = (fde.initial_address(), fde.end_address());
        if start >= end {
            continue;
        }
        let at = skip.partition_point(|&(s, _)| s < end);
        if skip[..at].iter().rev().take(4).any(|&(s, e)| s < end && start < e) {
            continue; // the other section already describes this code
        }
        covered.push((start, end));
        let signal_frame = fde.is_signal_trampoline();
        let Ok(mut table) = fde.rows(section, bases, ctx) else { continue };
        while let Ok(Some(row)) = table.next_row() {
            let rule = summarize(section, row, signal_frame).map_or(UnwindRule::STOP, rule_for);
            out.push(ranked(row.start_address(), FDE_ROW, rule));
        }
        // Up to the next FDE, code none describes: walked by its frame pointer.
        out.push(ranked(end, FDE_END, UnwindRule::FRAME_POINTER));
    }
}

fn summarize<S: UnwindSection<Slice>>(
    section: &S,
    row: &UnwindTableRow<usize>,
    signal_frame: bool,
) -> Option<RowSummary> {
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

    fn row(cfa: Cfa, ra: Saved, rbp: Saved) -> RowSummary {
        RowSummary { signal_frame: false, cfa, ra, rbp }
    }

    #[test]
    fn rows_become_rules_the_probes_can_walk() {
        let r = rule_for(row(Cfa::Sp(8), Saved::At(-8), Saved::Unchanged));
        assert_eq!((r.kind, r.cfa_offset, r.rbp_offset), (kind::CFA_SP, 8, 0));
        let r = rule_for(row(Cfa::Bp(16), Saved::At(-8), Saved::At(-16)));
        assert_eq!((r.kind, r.cfa_offset, r.rbp_offset), (kind::CFA_BP, 16, -16));
        let r = rule_for(row(Cfa::BpDeref(-8), Saved::At(-8), Saved::At(-16)));
        assert_eq!((r.kind, r.cfa_offset), (kind::CFA_BP_DEREF, -8));
        assert_eq!(rule_for(row(Cfa::Sp(8), Saved::Undefined, Saved::Unchanged)).kind, kind::OUTERMOST);
        assert_eq!(
            rule_for(RowSummary { signal_frame: true, ..row(Cfa::Other, Saved::Other, Saved::Other) }).kind,
            kind::SIGNAL
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
            assert_eq!(rule_for(r).kind, kind::STOP, "{r:?}");
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

    /// Our own executable's rows: sorted, merged, and a function's first instruction has
    /// CFA = rsp + 8 (the FDE's row wins over the end of the function before it).
    #[test]
    fn the_rows_of_a_real_binary() {
        let maps = crate::procfs::Maps::read_self().unwrap();
        let ip = marker();
        let m = maps.find(ip).unwrap();
        let cfi = Cfi::open(&m.path).unwrap();
        let rows = cfi.rows();
        assert!(rows.len() > 1000, "{} rows", rows.len());
        assert!(rows.windows(2).all(|w| w[0].pc < w[1].pc && w[0].rule != w[1].rule));
        assert!(rows.iter().all(|r| r.rule._pad == 0), "ranks are not left in the rules");
        let vaddr = vaddr_of_file_offset(&cfi.segments, m.file_offset(ip)).unwrap();
        let at = rows.partition_point(|r| r.pc <= vaddr) - 1;
        assert_eq!(rows[at].pc, vaddr, "a row starts at the function's entry");
        assert_eq!((rows[at].rule.kind, rows[at].rule.cfa_offset), (kind::CFA_SP, 8));
    }
}
