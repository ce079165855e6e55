//! plughost
