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
