//! Byte streams that are either owned or a window into a shared buffer (a loaded file or an mmap).

use std::ops::{Deref, Range};
use std::sync::Arc;

/// The backing store of a loaded delta: bytes in memory, a read-only file mapping, or immutable bytes owned by
/// someone else (the bindings lend a Python `bytes` object this way, without a copy).
pub enum Backing {
    Owned(Vec<u8>),
    Mapped(memmap2::Mmap),
    Borrowed(Box<dyn AsRef<[u8]> + Send + Sync>),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Owned(bytes) => bytes,
            Backing::Mapped(map) => map,
            Backing::Borrowed(bytes) => (**bytes).as_ref(),
        }
    }
}

impl Backing {
    /// Drops the pages of `range` from the process's memory when this is a file mapping, which keeps them: a later
    /// read faults them in again (from the page cache, or the file). Elsewhere a no-op.
    pub fn release(&self, range: Range<usize>) {
        if let Backing::Mapped(map) = self {
            // SAFETY: the mapping is read-only and private: dropping its pages only means re-reading the file.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
        }
    }
}

/// An encoded stream: owned after a diff, or borrowed from the file it was read from.
#[derive(Clone)]
pub enum Stream {
    Owned(Arc<Vec<u8>>),
    Shared { backing: Arc<Backing>, range: Range<usize> },
}

impl Stream {
    pub fn empty() -> Self {
        Stream::Owned(Arc::new(Vec::new()))
    }

    /// Drops the pages of `range` (within this stream) from the process's memory when the stream is a window onto
    /// a file mapping, which keeps them: a later read faults them in again. Elsewhere a no-op.
    pub fn release(&self, range: Range<usize>) {
        if let Stream::Shared { backing, range: window } = self {
            backing.release(window.start + range.start..window.start + range.end);
        }
    }
}

impl From<Vec<u8>> for Stream {
    fn from(bytes: Vec<u8>) -> Self {
        Stream::Owned(Arc::new(bytes))
    }
}

impl Deref for Stream {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Stream::Owned(bytes) => bytes,
            Stream::Shared { backing, range } => &backing[range.clone()],
        }
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({} bytes)", self.len())
    }
}
