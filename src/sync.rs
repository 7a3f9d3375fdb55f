//! Locks that outlive a panic. A worker that panics while holding a lock
//! poisons it; dmkit takes the data back rather than spreading that panic to
//! every thread that touches the same state (the panic itself is caught and
//! reported by [`crate::panics`], which fails the device it hit). Every lock,
//! condition-variable wait and `get_mut` in dmkit goes through [`Unpoison`].

use std::sync::PoisonError;

/// The value of a lock operation whether or not the lock was poisoned.
pub trait Unpoison<T> {
    fn unpoisoned(self) -> T;
}

impl<T> Unpoison<T> for Result<T, PoisonError<T>> {
    fn unpoisoned(self) -> T {
        self.unwrap_or_else(PoisonError::into_inner)
    }
}

/// A job for [`Workers`].
pub type Job = Box<dyn FnOnce() + Send>;

/// Threads that take jobs from one shared queue, started at the first job
/// (named `NAME-i`); they end when the pool is dropped. The copier's kcopyd
/// threads and the engine's hook workers are such pools.
pub struct Workers {
    name: &'static str,
    /// How many threads; 0: one per core, at most 8.
    threads: usize,
    queue: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Job>>>,
}

impl Workers {
    pub const fn new(name: &'static str, threads: usize) -> Workers {
        Workers {
            name,
            threads,
            queue: std::sync::OnceLock::new(),
        }
    }

    fn start(&self) -> Option<std::sync::mpsc::Sender<Job>> {
        let n = match self.threads {
            0 => std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(1, 8),
            n => n,
        };
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let mut started = 0;
        for i in 0..n {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{}-{i}", self.name))
                .spawn(move || loop {
                    let next = rx.lock().unpoisoned().recv();
                    match next {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                });
            started += usize::from(spawned.is_ok());
        }
        if started == 0 {
            tracing::warn!(
                "{}: no worker thread could be started: jobs run on the caller's thread",
                self.name
            );
        }
        (started > 0).then_some(tx)
    }

    /// Run `job` on a worker, or here if no worker could be started.
    pub fn run(&self, job: Job) {
        let job = match self.queue.get_or_init(|| self.start()) {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        job();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_poisoned_lock_still_gives_its_data() {
        let m = Arc::new(Mutex::new(7));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unpoisoned();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*m.lock().unpoisoned(), 7);
    }
}
