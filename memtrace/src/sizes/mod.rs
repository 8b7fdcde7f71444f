//! Usable sizes of the allocator families memtrace recognises, computed from their size
//! classes the way each library computes `malloc_usable_size` (no read of the block's
//! memory). Each model is for the configuration of the build named in its module; the tests
//! compare them with tables the real libraries produced.
pub mod jemalloc;
pub mod mimalloc;
pub mod tcmalloc;
pub mod usable;

#[cfg(test)]
mod tests;

/// An allocator family: who serves a module's malloc and how its usable size is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// glibc's ptmalloc: the probes read the chunk header.
    Glibc,
    /// jemalloc 5.x (any prefix).
    Jemalloc,
    /// mimalloc 2.0.
    Mimalloc,
    /// gperftools' tcmalloc (and tcmalloc_minimal).
    Tcmalloc,
    /// musl's mallocng (static binaries): usable == requested.
    Musl,
    /// Something else with a malloc/free pair (a custom allocator, `--symbol-prefix`).
    Unknown,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Self::Glibc => "glibc",
            Self::Jemalloc => "jemalloc",
            Self::Mimalloc => "mimalloc",
            Self::Tcmalloc => "tcmalloc",
            Self::Musl => "musl",
            Self::Unknown => "unknown",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Glibc, Self::Jemalloc, Self::Mimalloc, Self::Tcmalloc, Self::Musl, Self::Unknown]
            .into_iter()
            .find(|f| f.name() == name)
    }

    /// How `bytes_alloc` is derived, for the report's summary.
    pub fn usable_source(self) -> &'static str {
        match self {
            Self::Glibc => "usable size read from glibc's chunk headers",
            Self::Jemalloc => "usable size from jemalloc's size classes",
            Self::Mimalloc => "usable size from mimalloc's bins (aligned blocks: from its page metadata)",
            Self::Tcmalloc => "usable size from tcmalloc's class table",
            Self::Musl => "usable size = requested (musl keeps the request)",
            Self::Unknown => "allocator unknown to memtrace: usable size unknown, allocated = requested",
        }
    }
}
