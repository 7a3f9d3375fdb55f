//! One request's work over its data, split between the calling thread and
//! threads scoped to the call, as the kernel's dm-crypt and dm-verity hand a
//! bio's work to per-CPU workqueues: a long read's decryption or hashing
//! would otherwise wait on one core while the others idle.

use crate::sync::Unpoison;
use std::sync::Mutex;

/// The most threads one request's work is split between.
pub const MAX_THREADS: usize = 8;

/// Threads a request's work may use: one a CPU, at most [`MAX_THREADS`].
pub fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_THREADS)
}

/// `work(at, a_part, b_part)` over `a` and `b` (as long as each other), cut
/// at the same byte offsets `at` into up to `threads` parts of whole `unit`s,
/// at least `min_units` each (a shorter request, or `a` and `b` of different
/// lengths, is one part): the first part on this thread, the others on
/// threads of their own. A thread that cannot start leaves its part to this
/// one. The results in the parts' order; None for a part whose thread
/// panicked.
pub fn split<R, W>(
    threads: usize,
    unit: usize,
    min_units: usize,
    a: &[u8],
    b: &mut [u8],
    work: &W,
) -> Vec<Option<R>>
where
    R: Send,
    W: Fn(usize, &[u8], &mut [u8]) -> R + Sync,
{
    let units = b.len() / unit.max(1);
    let parts = threads.min(units / min_units.max(1)).max(1);
    if parts == 1 || a.len() != b.len() {
        return vec![Some(work(0, a, b))];
    }
    let per = units.div_ceil(parts) * unit;
    type Part<'p> = Mutex<Option<(usize, &'p [u8], &'p mut [u8])>>;
    let slots: Vec<Part<'_>> = a
        .chunks(per)
        .zip(b.chunks_mut(per))
        .enumerate()
        .map(|(k, (x, y))| Mutex::new(Some((k * per, x, y))))
        .collect();
    // a part is taken once, by its thread or, failing that, by this one
    let take = |s: &Part<'_>| s.lock().unpoisoned().take().map(|(at, x, y)| work(at, x, y));
    std::thread::scope(|sc| {
        let (first, rest) = slots.split_first().map_or((None, &[][..]), |(f, r)| (Some(f), r));
        let started: Vec<_> = rest
            .iter()
            .map(|s| std::thread::Builder::new().spawn_scoped(sc, move || take(s)))
            .collect();
        let mut out = vec![first.and_then(take)];
        for (s, h) in rest.iter().zip(started) {
            out.push(match h {
                Ok(h) => h.join().ok().flatten(),
                Err(_) => take(s),
            });
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_data_once_at_their_offsets() {
        let a: Vec<u8> = (0..64 * 10).map(|i| i as u8).collect();
        for threads in [1, 2, 3, 8] {
            let mut b = vec![0u8; a.len()];
            let r = split(threads, 64, 2, &a, &mut b, &|at, x: &[u8], y: &mut [u8]| {
                assert_eq!(x.as_ptr(), a[at..].as_ptr(), "a part of a at its offset");
                y.copy_from_slice(x);
                (at, x.len())
            });
            assert_eq!(b, a, "{threads} threads");
            let parts = threads.min(5);
            assert_eq!(r.len(), parts);
            assert_eq!(r.iter().map(|p| p.map_or(0, |(_, n)| n)).sum::<usize>(), a.len());
            assert!(r.windows(2).all(|w| w[0].map(|p| p.0) < w[1].map(|p| p.0)));
        }
        // shorter than two parts' worth, or lengths apart: one part
        let mut b = vec![0u8; 64 * 3];
        assert_eq!(split(8, 64, 2, &a[..64 * 3], &mut b, &|_, _, _| ()).len(), 1);
        assert_eq!(split(8, 64, 2, &a, &mut b, &|_, _, _| ()).len(), 1);
    }
}
