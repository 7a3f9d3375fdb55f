//! Page-aligned buffers for O_DIRECT I/O, allocated once and reused.

/// Alignment of every request buffer: enough for O_DIRECT on any Linux device.
pub const BUF_ALIGN: usize = 4096;

/// A byte buffer whose start is aligned to [`BUF_ALIGN`]. It over-allocates a `Vec` and
/// uses the aligned window, so no unsafe allocation code is needed.
#[derive(Default)]
pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.ensure(len);
        b
    }

    /// Make the buffer at least `len` bytes long; contents are not preserved when it
    /// grows. Growth is the only allocation, so steady-state I/O allocates nothing.
    pub fn ensure(&mut self, len: usize) {
        if len <= self.len {
            return;
        }
        let cap = len.next_power_of_two().max(BUF_ALIGN);
        self.raw = vec![0u8; cap + BUF_ALIGN];
        self.start = self.raw.as_ptr().align_offset(BUF_ALIGN);
        self.len = cap;
    }

    pub fn capacity(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }

    /// Let the kernel take the buffer's pages back if memory runs short
    /// (MADV_FREE): its contents become zero or stay as they were. For buffers
    /// that are large but rarely full (a ublk tag's, sized for the largest
    /// request), so a device that once saw large requests does not keep their
    /// memory.
    pub fn release(&mut self) {
        let len = self.len & !(BUF_ALIGN - 1);
        if len == 0 {
            return;
        }
        let p = self.as_mut_ptr();
        // SAFETY: [p, p + len) is inside this buffer's allocation, page-aligned
        // (BUF_ALIGN is the page size) and owned by `&mut self`: nothing else
        // reads or writes it during the call, and MADV_FREE only lets the kernel
        // replace its pages by zero ones, which any byte values allow.
        let r = unsafe { libc::madvise(p.cast(), len, libc::MADV_FREE) };
        debug_assert!(r == 0 || r == -1);
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_grows() {
        let mut b = AlignedBuf::new(100);
        assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
        assert!(b.capacity() >= 100);
        b.ensure(1 << 20);
        assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
        assert!(b.capacity() >= 1 << 20);
    }
}
