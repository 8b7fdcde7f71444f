//! The CPython structure layouts memtrace reads, one row per supported version (3.10 to
//! 3.13, x86-64 release builds with the GIL; values from each version's headers, see
//! docs/research/cpython-frames.md §1). 3.13 takes its frame, thread and code offsets from
//! the interpreter's own `_Py_DebugOffsets` ([`Layout::from_debug_offsets`]); the table's
//! values are the fallback and the check.
use memtrace_common::python::{PY_NONE, PyProcInfo};

/// What memtrace reads of one CPython version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub minor: u8,
    /// `sizeof(_PyRuntimeState)`: the `_PyRuntime` symbol's size, a fingerprint of the
    /// layout (a debug or free-threaded build differs).
    pub runtime_size: u64,
    /// `_PyRuntime` → `autoTSSkey._key`.
    pub tss_key: u64,
    /// The probes' part (`tss_key_addr` and the pthread offsets filled per process).
    pub probes: PyProcInfo,
    pub code: CodeLayout,
}

/// Offsets into a code object and the strings it points to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeLayout {
    pub flags: u64,
    pub firstlineno: u64,
    pub filename: u64,
    pub name: u64,
    /// `co_qualname` (None on 3.10: the name only).
    pub qualname: Option<u64>,
    pub linetable: u64,
    /// Where a compact ASCII string's characters start (`sizeof(PyASCIIObject)`).
    pub ascii_data: u64,
    /// Where a compact non-ASCII string's characters start.
    pub compact_data: u64,
}

const fn probes(
    minor: u16,
    ts_thread_id: u16,
    ts_frame: u16,
    cframe_current: u16,
    f: [u16; 6], // code, back, instr, entry, owner, globals
    co_code: u16,
) -> PyProcInfo {
    PyProcInfo {
        tss_key_addr: 0,
        pthread_specific_1st: 0,
        pthread_specific: 0,
        ts_thread_id,
        ts_frame,
        cframe_current,
        f_code: f[0],
        f_back: f[1],
        f_instr: f[2],
        f_entry: f[3],
        f_owner: f[4],
        f_globals: f[5],
        co_code,
        minor,
        co_firstlineno: 0,
        co_filename: 0,
        co_qualname: 0,
        co_linetable: 0,
        str_ascii_data: 0,
        _pad: 0,
    }
}

/// Code objects and strings of 3.12 and 3.13 (the same).
const CODE_312: CodeLayout = CodeLayout {
    flags: 48,
    firstlineno: 68,
    filename: 112,
    name: 120,
    qualname: Some(128),
    linetable: 136,
    ascii_data: 40,
    compact_data: 56,
};

pub const LAYOUTS: [Layout; 4] = [
    Layout {
        minor: 10,
        runtime_size: 672,
        tss_key: 588,
        // PyFrameObject: f_back 24, f_code 32, f_globals 48, f_lasti 96 (an index).
        probes: probes(10, 176, 24, PY_NONE, [32, 24, 96, PY_NONE, PY_NONE, 48], PY_NONE),
        code: CodeLayout {
            flags: 36,
            firstlineno: 40,
            filename: 104,
            name: 112,
            qualname: None,
            linetable: 120,
            ascii_data: 48,
            compact_data: 72,
        },
    },
    Layout {
        minor: 11,
        runtime_size: 166_688,
        tss_key: 596,
        // _PyInterpreterFrame: f_func 0, f_globals 8, f_code 32, previous 48, prev_instr 56.
        probes: probes(11, 152, 56, 8, [32, 48, 56, 68, PY_NONE, 8], 184),
        code: CodeLayout {
            flags: 48,
            firstlineno: 72,
            filename: 112,
            name: 120,
            qualname: Some(128),
            linetable: 136,
            ascii_data: 48,
            compact_data: 72,
        },
    },
    Layout {
        minor: 12,
        runtime_size: 459_944,
        tss_key: 1548,
        // _PyInterpreterFrame: f_code 0, previous 8, f_funcobj 16, f_globals 24.
        probes: probes(12, 136, 56, 0, [0, 8, 56, PY_NONE, 70, 24], 192),
        code: CODE_312,
    },
    Layout {
        minor: 13,
        runtime_size: 283_320,
        tss_key: 2164,
        // As 3.12 (f_executable for f_code); `_Py_DebugOffsets` does not publish f_globals.
        probes: probes(13, 152, 72, PY_NONE, [0, 8, 56, PY_NONE, 70, 24], 200),
        code: CODE_312,
    },
];

/// The cookie `_Py_DebugOffsets` starts with.
pub const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";
/// Bytes of `_Py_DebugOffsets` read (3.13).
pub const DEBUG_OFFSETS_LEN: usize = 0x240;

impl Layout {
    pub fn for_minor(minor: u8) -> Option<Layout> {
        LAYOUTS.iter().copied().find(|l| l.minor == minor)
    }

    /// 3.13: the layout with the offsets the interpreter publishes in `_PyRuntime`'s first
    /// bytes. None when they are not 3.13's (another minor version, a free-threaded build).
    pub fn from_debug_offsets(&self, d: &[u8]) -> Option<Layout> {
        let at = |off: usize| -> Option<u64> { Some(u64::from_le_bytes(d.get(off..off + 8)?.try_into().ok()?)) };
        let small = |off: usize| -> Option<u16> { u16::try_from(at(off)?).ok().filter(|&v| v < PY_NONE) };
        if d.get(..8)? != DEBUG_COOKIE || (at(0x08)? >> 16) != 0x030d || at(0x10)? != 0 {
            return None;
        }
        let mut l = *self;
        l.runtime_size = at(0x18)?;
        l.probes.ts_thread_id = small(0xc0)?;
        l.probes.ts_frame = small(0xb8)?;
        l.probes.f_back = small(0xe8)?;
        l.probes.f_code = small(0xf0)?;
        l.probes.f_instr = small(0xf8)?;
        l.probes.f_owner = small(0x108)?;
        l.probes.co_code = small(0x158)?;
        l.code.filename = at(0x118)?;
        l.code.name = at(0x120)?;
        l.code.qualname = Some(at(0x128)?);
        l.code.linetable = at(0x130)?;
        l.code.firstlineno = at(0x138)?;
        l.code.ascii_data = at(0x230)?;
        Some(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The debug offsets a 3.13.0 process published (docs/research/cpython-frames.md §5)
    /// give the table's own values.
    #[test]
    fn debug_offsets_of_313_agree_with_the_table() {
        let mut d = vec![0u8; DEBUG_OFFSETS_LEN];
        let mut put = |off: usize, v: u64| d[off..off + 8].copy_from_slice(&v.to_le_bytes());
        put(0x08, 0x030d00f0);
        put(0x18, 283_320);
        for (off, v) in [
            (0xb8, 72),
            (0xc0, 152),
            (0xe8, 8),
            (0xf0, 0),
            (0xf8, 56),
            (0x108, 70),
            (0x118, 112),
            (0x120, 120),
            (0x128, 128),
            (0x130, 136),
            (0x138, 68),
            (0x158, 200),
            (0x230, 40),
        ] {
            put(off, v);
        }
        d[..8].copy_from_slice(DEBUG_COOKIE);
        let table = Layout::for_minor(13).unwrap();
        assert_eq!(table.from_debug_offsets(&d), Some(table));
        // Another version's, or a free-threaded build's, are refused.
        d[0x10] = 1;
        assert_eq!(table.from_debug_offsets(&d), None);
    }
}
