"""Shared test code: fixtures and builders that test modules import (never one test module from another)."""
