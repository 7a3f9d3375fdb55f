//! Sizes and counts read from metadata are bounded here before anything is
//! sized by them. A block whose checksum is right can still lie (an edited and
//! re-sealed superblock, a buggy writer), so every reader that turns an on-disk
//! number into an allocation or a loop bound passes it through [`field`] (against
//! what the device it describes can hold) and allocates with [`zeroed_vec`]
//! (against what memory allows). The error names the field and the block.

use super::error::{PdataError, Result};

/// `value` of `field` (read from metadata block `block`) must not exceed
/// `limit`; `why` says what the limit is, for the error.
pub fn field(block: u64, field: &'static str, value: u64, limit: u64, why: impl Into<String>) -> Result<u64> {
    if value > limit {
        return Err(PdataError::Field {
            block,
            field,
            value,
            limit,
            why: why.into(),
        });
    }
    Ok(value)
}

/// Block numbers a superblock (block `block`) names: each must lie on the
/// metadata device of `dev_blocks` blocks.
pub fn roots(block: u64, roots: &[(&'static str, u64)], dev_blocks: u64) -> Result<()> {
    for &(name, v) in roots {
        field(
            block,
            name,
            v,
            dev_blocks.saturating_sub(1),
            "the metadata device's last block",
        )?;
    }
    Ok(())
}

/// The most memory one in-core table sized by metadata may take: the machine's
/// physical memory. Anything larger could only be had by overcommit and would
/// end in the OOM killer or an abort instead of an error.
pub fn memory_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let info = rustix::system::sysinfo();
        // totalram is 32 bits wide on 32-bit targets
        #[allow(clippy::useless_conversion)]
        u64::from(info.totalram).saturating_mul(u64::from(info.mem_unit))
    })
}

/// A vector of `n` default (zero) elements, `n` having been read from `field`
/// of metadata block `block`: refused with an error naming them when it would
/// exceed [`memory_limit`] or the allocator says no, never an abort.
pub fn zeroed_vec<T: Clone + Default>(block: u64, field: &'static str, n: u64) -> Result<Vec<T>> {
    let mut v = Vec::new();
    resize(&mut v, block, field, n)?;
    Ok(v)
}

/// Grow (or shrink) `v` to `n` elements, new ones default, within the same bound.
pub fn resize<T: Clone + Default>(v: &mut Vec<T>, block: u64, field: &'static str, n: u64) -> Result<()> {
    resize_within(v, block, field, n, memory_limit())
}

fn resize_within<T: Clone + Default>(
    v: &mut Vec<T>,
    block: u64,
    name: &'static str,
    n: u64,
    limit: u64,
) -> Result<()> {
    let size = std::mem::size_of::<T>().max(1) as u64;
    let refuse = || PdataError::Field {
        block,
        field: name,
        value: n,
        limit: limit / size,
        why: format!("memory allows ({} MiB at {size} bytes each)", limit >> 20),
    };
    let bytes = n.checked_mul(size).ok_or_else(refuse)?;
    if bytes > limit {
        return Err(refuse());
    }
    let len = usize::try_from(n).map_err(|_| refuse())?;
    v.try_reserve_exact(len.saturating_sub(v.len()))
        .map_err(|_| refuse())?;
    v.resize(len, T::default());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_names_itself_and_the_block() {
        assert_eq!(field(0, "nr_blocks", 10, 10, "the device").unwrap(), 10);
        let e = field(7, "nr_blocks", 11, 10, "the device holds").unwrap_err();
        assert_eq!(
            e.to_string(),
            "metadata block 7: nr_blocks is 11, more than the device holds (10)"
        );
    }

    #[test]
    fn memory_bound_is_an_error_not_an_abort() {
        let mut v: Vec<u64> = vec![1];
        resize_within(&mut v, 0, "n", 4, 32).unwrap();
        assert_eq!(v, [1, 0, 0, 0]);
        let e = resize_within(&mut v, 3, "data nr_blocks", 5, 32).unwrap_err();
        assert_eq!(v.len(), 4);
        assert!(
            e.to_string().starts_with("metadata block 3: data nr_blocks is 5"),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("more than memory allows (0 MiB at 8 bytes each) (4)"),
            "{e}"
        );
        // overflowing the byte count, and far past any machine
        assert!(zeroed_vec::<u64>(0, "n", u64::MAX).is_err());
        assert!(zeroed_vec::<u8>(0, "n", 1 << 50).is_err());
        assert!(memory_limit() > 1 << 20);
    }
}
