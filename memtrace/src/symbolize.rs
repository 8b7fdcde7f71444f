//! Turning addresses into names with blazesym: one long-lived symbolizer, called once per
//! object with every distinct offset of that object in one batch. Results are inline
//! chains, innermost function first, each with its own source location.
use std::path::Path;

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer as Blaze,
    source::{Elf, Kernel, Source},
};

use crate::recording::Symbol;

pub struct Symbolizer {
    blaze: Blaze,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

fn chain(sym: &blazesym::symbolize::Sym<'_>) -> Vec<Symbol> {
    let location = |ci: Option<&blazesym::symbolize::CodeInfo<'_>>| -> (Option<String>, u32) {
        match ci {
            Some(ci) => {
                let file = match &ci.dir {
                    Some(dir) if !dir.as_os_str().is_empty() => dir.join(&ci.file).to_string_lossy().into_owned(),
                    _ => ci.file.to_string_lossy().into_owned(),
                };
                (Some(file), ci.line.unwrap_or(0))
            }
            None => (None, 0),
        }
    };
    let mut out = Vec::with_capacity(sym.inlined.len() + 1);
    for inlined in sym.inlined.iter().rev() {
        let (file, line) = location(inlined.code_info.as_ref());
        out.push(Symbol { name: inlined.name.to_string(), file, line, inlined: true });
    }
    let (file, line) = location(sym.code_info.as_deref());
    out.push(Symbol { name: sym.name.to_string(), file, line, inlined: false });
    out
}

impl Symbolizer {
    pub fn new() -> Self {
        Self { blaze: Blaze::builder().enable_code_info(true).enable_inlined_fns(true).enable_demangling(true).build() }
    }

    fn run(&self, src: &Source<'_>, input: Input<&[u64]>, n: usize) -> Vec<Vec<Symbol>> {
        match self.blaze.symbolize(src, input) {
            Ok(results) => results
                .iter()
                .map(|r| match r {
                    Symbolized::Sym(sym) => chain(sym),
                    Symbolized::Unknown(_) => Vec::new(),
                })
                .collect(),
            Err(_) => vec![Vec::new(); n],
        }
    }

    /// Kernel text addresses (kallsyms, or a vmlinux with debug info when one is found).
    pub fn kernel(&self, addrs: &[u64]) -> Vec<Vec<Symbol>> {
        if addrs.is_empty() {
            return Vec::new();
        }
        let src = Source::Kernel(Kernel::default());
        self.run(&src, Input::AbsAddr(addrs), addrs.len())
    }

    /// File offsets inside the ELF object at `path` (DWARF and separate debug info used
    /// when present, else the symbol tables).
    pub fn object(&self, path: &Path, offsets: &[u64]) -> Vec<Vec<Symbol>> {
        if offsets.is_empty() {
            return Vec::new();
        }
        let src = Source::Elf(Elf::new(path));
        self.run(&src, Input::FileOffset(offsets), offsets.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn a_function_with_a_distinctive_name() -> usize {
        std::hint::black_box(a_function_with_a_distinctive_name as *const () as usize)
    }

    #[test]
    fn symbolizes_our_own_function_by_file_offset() {
        let addr = a_function_with_a_distinctive_name() as u64;
        let maps = crate::procfs::Maps::read_self().unwrap();
        let mapping = maps.find(addr).unwrap();
        let offset = mapping.file_offset(addr);
        let result = Symbolizer::new().object(&mapping.path, &[offset, 0]);
        assert_eq!(result.len(), 2);
        let outer = result[0].last().unwrap();
        assert!(outer.name.contains("a_function_with_a_distinctive_name"), "{result:?}");
        assert!(outer.file.as_deref().unwrap_or("").ends_with("symbolize.rs"), "{result:?}");
    }

    #[test]
    fn symbolizes_kernel_text() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let addr = kallsyms
            .lines()
            .find_map(|l| {
                let mut parts = l.split_whitespace();
                let addr = u64::from_str_radix(parts.next()?, 16).ok()?;
                let _type = parts.next()?;
                (parts.next()? == "schedule").then_some(addr)
            })
            .filter(|&a| a != 0)
            .expect("schedule in /proc/kallsyms with a real address (tests run as root)");
        let result = Symbolizer::new().kernel(&[addr + 1]);
        assert_eq!(result[0].last().unwrap().name, "schedule");
    }
}
