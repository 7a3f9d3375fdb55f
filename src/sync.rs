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
