//! thin_trim: discard the data blocks a pool's metadata calls free.

use super::{Result, ThinError, ThinPoolMetadata};
use std::ops::Range;
use std::path::Path;

/// The runs of data blocks no mapping uses, ascending.
pub fn free_runs(md: &ThinPoolMetadata) -> impl Iterator<Item = Range<u64>> + '_ {
    let nr = md.nr_data_blocks();
    let mut b = 0;
    std::iter::from_fn(move || {
        while b < nr && md.data_block_ref_count(b) != 0 {
            b += 1;
        }
        if b >= nr {
            return None;
        }
        let start = b;
        while b < nr && md.data_block_ref_count(b) == 0 {
            b += 1;
        }
        Some(start..b)
    })
}

/// Punch holes in the data device or file `data` where `md`'s data blocks are
/// free; a free run at the end extends to the end of `data`.
pub fn discard_free(md: &ThinPoolMetadata, data: &Path) -> Result<()> {
    let at = |e: std::io::Error| ThinError::Plain(format!("{}: {e}", data.display()));
    let block_bytes = md.data_block_size() as u64 * 512;
    let nr = md.nr_data_blocks();
    let f = std::fs::OpenOptions::new().write(true).open(data).map_err(at)?;
    // seek-to-end sizes block devices too
    let size = {
        use std::io::Seek;
        (&f).seek(std::io::SeekFrom::End(0)).map_err(at)?
    };
    let want = nr.saturating_mul(block_bytes);
    if size < want {
        return Err(ThinError::Plain(format!(
            "unexpected data device size, wanted {want} bytes"
        )));
    }
    for run in free_runs(md) {
        let len = if run.end == nr {
            size - run.start * block_bytes
        } else {
            (run.end - run.start) * block_bytes
        };
        use rustix::fs::{fallocate, FallocateFlags};
        fallocate(
            &f,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            run.start * block_bytes,
            len,
        )
        .map_err(|e| {
            ThinError::Plain(format!(
                "{}: discard of blocks {}..{}: {e}",
                data.display(),
                run.start,
                run.end
            ))
        })?;
    }
    Ok(())
}
